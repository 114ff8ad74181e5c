"""Qwen4-Exp's query-sparse attention (QSA) under Ulysses SP, exact.

Qwen4-Exp's sparse layers attend each query to a token budget. Its document's visible keys are cut into blocks of
``indexer_compress_ratio`` tokens from the document's first token; a complete block's key is the RMS-normed mean of
its tokens' indexer keys with RoPE at the block's first position; the query scores the complete blocks it sees
(``sum_h relu(q_h . k_block) / sqrt(d)``, fp32, no gradient), keeps the top ``indexer_budget / ratio`` of them and
always the tail of its own incomplete block. transformers computes this per query over the mask SP doesn't pass and
hands it to the attention as a mask. Under SP (``mixers.swap``, behaviour-checked):

1. the attention computes the selection first (``sp_qsa_select``): the indexer keys and their RoPE tables are
   all-gathered, every complete block of the whole sequence is pooled once, this rank's queries score the blocks in
   query tiles of bounded memory, and the picks, whole-sequence token positions ``[b, seq, budget + ratio - 1]``
   int32 (unused slots repeat a pick), are all-gathered;
2. its installed forward then runs with a one-element mask (its indexer, swapped, returns one too: nothing of
   ``s x seq`` is built) and hands the positions to SP's attention as ``indices=``, which attends each query to them
   within its document (``dsa.selected_attention``).

Exact when the top-k picks the same blocks as one device: the block scores are the same fp32 sums, so only blocks
tied at the k-th place can differ. With a ring, as for DSA: the selection over the zigzag shards, gathered in
sequence order, and the ring group's K/V gathered (``dsa.ring_gather``).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..sharding.sequence import SequenceSharding
from .block_sparse import complete_windows, document_positions, windows_seen
from .dsa import SCORE_BYTES, gather_sequence, local_positions


def qsa_projection(indexer: torch.nn.Module, hidden_states, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """``Qwen4ExpTextQSAIndexer.forward``'s queries ``[b, s, H, D]`` (normed, RoPE; fp32) and raw keys ``[b, s, D]``."""
    rope = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
    b, s, _ = hidden_states.shape
    dim = indexer.index_head_dim
    q, keys = indexer.index_qk_proj(hidden_states).split(
        [indexer.index_n_heads * dim, indexer.index_kv_heads * dim], dim=-1
    )
    cos, sin = position_embeddings
    q = rope(indexer.q_layernorm(q.reshape(b, s, -1, dim)), cos=cos, sin=sin, unsqueeze_dim=2)
    return q.float(), keys.reshape(b, s, -1, dim).squeeze(2)


def pooled_blocks(indexer: torch.nn.Module, keys, cos, sin, bounds: torch.Tensor):
    """Every complete block of the whole sequence (``keys``, ``cos``, ``sin``: ``[b, seq, .]``): its row, its first
    position and its key ``[n, D]`` (fp32: the mean of its keys, normed, RoPE at its first position)."""
    rope = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
    b, seq, _ = keys.shape
    ratio = indexer.compress_ratio
    docs, pos = document_positions(bounds, b, seq, keys.device)
    rows, starts, _, _ = complete_windows(bounds, b, seq, ratio, keys.device)
    span = starts[:, None] + torch.arange(ratio, device=keys.device)
    pooled = keys[rows[:, None], span].float().mean(dim=1).to(keys.dtype)
    pooled = indexer.k_layernorm(pooled).unsqueeze(1)
    block_keys = rope(pooled, cos=cos[rows, starts], sin=sin[rows, starts]).squeeze(1)
    return rows, starts, block_keys.float(), docs, pos


@torch.no_grad()
def sp_qsa_select(
    indexer: torch.nn.Module,
    projected: tuple[torch.Tensor, torch.Tensor],
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    bounds: torch.Tensor,
    group: dist.ProcessGroup | None,
    rank: int,
    sharding: SequenceSharding | None = None,
) -> torch.Tensor:
    """``[b, seq, budget + ratio - 1]`` int32: for every query of the whole sequence (in sequence order), the
    whole-sequence positions of the tokens it attends to (its top blocks' and its incomplete block's; unused slots
    repeat its first pick). ``projected``: SP rank ``rank``'s queries and keys (``qsa_projection``), its shard of the
    ``sharding`` (a ring's zigzag one; ``None``: contiguous shards), gathered over ``group`` with their RoPE tables."""
    q, keys = projected
    b, s, heads, dim = q.shape
    ratio, topk = indexer.compress_ratio, indexer.block_topk
    cos, sin = (gather_sequence(t.contiguous(), group, sharding) for t in position_embeddings)
    whole_keys = gather_sequence(keys.contiguous(), group, sharding)
    rows, starts, block_keys, docs, pos = pooled_blocks(indexer, whole_keys, cos, sin, bounds)
    block_docs, block_ends = docs[rows, starts], starts + ratio - 1
    within = torch.arange(ratio, device=q.device)
    tile = max(1, SCORE_BYTES // (4 * b * heads * max(len(starts), 1)))
    positions = local_positions(s, rank, sharding, q.device)
    picks = []
    for first in range(0, s, tile):
        local = slice(first, min(s, first + tile))
        queries = positions[local]  # whole-sequence positions
        scores = torch.relu(torch.matmul(q[:, local], block_keys.T)).sum(dim=2) / dim**0.5  # [b, t, n]
        seen = windows_seen(block_docs, block_ends, docs, queries)
        top = scores.masked_fill(~seen, float("-inf")).topk(min(topk, len(starts)), dim=-1)
        chosen = (starts[top.indices][..., None] + within).flatten(2)  # [b, t, k * ratio]
        chosen_ok = top.values.isfinite().repeat_interleave(ratio, dim=-1)
        own = pos[:, queries, None]  # [b, t, 1]: each query's position in its document
        tail = queries[:, None] - own + (own + 1) // ratio * ratio + within[: ratio - 1]  # its incomplete block
        tail_ok = within[: ratio - 1] < (own + 1) % ratio
        both, ok = torch.cat([chosen, tail], -1), torch.cat([chosen_ok, tail_ok], -1)
        pad = topk * ratio + ratio - 1 - both.shape[-1]  # fewer blocks in the whole sequence than the top-k
        both, ok = F.pad(both, (0, pad)), F.pad(ok, (0, pad))
        first_ok = both.gather(-1, ok.int().argmax(-1, keepdim=True))
        picks.append(torch.where(ok, both, first_ok).to(torch.int32))
    return gather_sequence(torch.cat(picks, dim=1), group, sharding)
