"""MiniMax-M3's block-sparse attention under Ulysses SP, exact.

MiniMax-M3's sparse layers choose, for each query and each KV group, ``index_topk_blocks`` blocks of
``index_block_size`` keys (blocks counted from the document's first token): a lightning indexer (one shared key per
token, a query per group, fp32 dot products, no gradient) scores the query's visible keys, each block scores the max
of its keys, and the ``index_local_blocks`` blocks ending at the query's own always win. The attention then attends
each query head to its group's selected blocks, causally. transformers' indexer scores a rank's queries against its
own keys and anchors the blocks at row slots. Under SP (``mixers.swap``, behaviour-checked):

1. the indexer (``sp_block_topk``) all-gathers the indexer keys, pools this rank's queries' scores into their
   document's blocks in query tiles of bounded memory and all-gathers the selections: ``[b, G, seq, k]`` int32
   document block ids, ``-1`` unused (transformers' contract, for each document alone);
2. the attention's forward runs as installed and hands them to SP's attention as ``block_indices=`` (as to its own
   non-eager kernels), which attends each query head to its group's selected blocks within its document
   (``dsa.selected_attention`` with ``block_keep``).

Exact when the top-k picks the same blocks as one device: the block scores are maxima of the same fp32 products,
so only blocks tied at the k-th place can differ. With a ring, as for DSA: the selections over the zigzag shards,
gathered in sequence order, and the ring group's K/V gathered (``dsa.ring_gather``).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

from ..sharding.sequence import SequenceSharding
from .dsa import (
    SCORE_BYTES,
    document_causal,
    document_ids,
    gather_sequence,
    gather_tokens,
    local_positions,
    selected_attention,
)

BLOCKS_KWARG = "block_indices"  # how transformers' MiniMax-M3 attention hands its block selection to a kernel


def document_positions(bounds: torch.Tensor, rows: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, seq]`` each position's document (``dsa.document_ids``) and its position within it."""
    docs = document_ids(bounds, rows, seq, device)
    flat = torch.arange(rows * seq, device=device).view(rows, seq)
    return docs, flat - bounds.to(device)[docs - 1]


def complete_windows(bounds: torch.Tensor, rows: int, seq: int, size: int, device):
    """Every complete window of ``size`` tokens counted from its document's first token (Qwen4-Exp's blocks,
    DeepSeek-V4's compressor windows): its row, first position, position in its document and document."""
    docs, pos = document_positions(bounds, rows, seq, device)
    bounds = bounds.to(device)
    row, start = ((pos % size == 0) & (pos + size <= bounds[docs] - bounds[docs - 1])).nonzero(as_tuple=True)
    return row, start, pos[row, start], docs[row, start]


def windows_seen(doc: torch.Tensor, end: torch.Tensor, docs: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``[b, len(queries), n]``: window ``e`` (its document ``doc[e]``, last position ``end[e]``) is complete before
    each query of ``queries`` (whole-sequence positions) in the query's document (``docs``: ``[b, seq]``; documents
    are numbered over the rows laid end to end, so no other row's window matches)."""
    return (docs[:, queries, None] == doc) & (end <= queries[:, None])


def m3_projection(indexer: torch.nn.Module, hidden_states, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """``MiniMaxM3VLIndexer.forward``'s queries ``[b, G, s, D]`` (fp32) and keys ``[b, s, D]`` (the model's dtype: made
    fp32 once gathered, exactly), RoPE applied."""
    rope = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
    b, s, _ = hidden_states.shape
    dim = indexer.head_dim
    q = indexer.q_norm(indexer.q_proj(hidden_states).view(b, s, -1, dim)).transpose(1, 2)
    k = indexer.k_norm(indexer.k_proj(hidden_states).view(b, s, 1, dim)).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = rope(q, k, cos[..., :dim], sin[..., :dim])
    return q.float(), k[:, 0]


@torch.no_grad()
def sp_block_topk(
    indexer: torch.nn.Module,
    projected: tuple[torch.Tensor, torch.Tensor],
    bounds: torch.Tensor,
    group: dist.ProcessGroup | None,
    rank: int,
    sharding: SequenceSharding | None = None,
) -> torch.Tensor:
    """``[b, G, seq, k]`` int32: for every query of the whole sequence (in sequence order) and KV group, the document
    block ids of its top-k blocks (``-1``: unused slots), as transformers' indexer selects them on the query's
    document alone. ``projected``: SP rank ``rank``'s ``m3_projection``, its shard of the ``sharding`` (a ring's
    zigzag one; ``None``: contiguous shards); keys and selections are gathered over ``group``."""
    q, keys = projected
    b, heads, s, _ = q.shape
    keys = gather_sequence(keys.contiguous(), group, sharding).float()
    seq = keys.shape[1]
    size = indexer.block_size
    docs, positions = document_positions(bounds, b, seq, q.device)
    n_blocks = int(positions.max()) // size + 1  # of the longest document
    key_blocks = (positions // size)[:, None, None, :]
    topk = min(indexer.topk_blocks, n_blocks)
    local = torch.arange(indexer.local_blocks, device=q.device)
    tile = max(1, SCORE_BYTES // (4 * heads * seq * b))
    mine = local_positions(s, rank, sharding, q.device)
    picks = []
    for start in range(0, s, tile):
        rows = slice(start, min(s, start + tile))
        queries = mine[rows]
        scores = torch.matmul(q[:, :, rows], keys.transpose(-1, -2).unsqueeze(1))  # [b, G, tile, seq]
        scores = scores.masked_fill(~document_causal(docs, queries)[:, None], float("-inf"))
        pooled = scores.new_full((*scores.shape[:3], n_blocks), float("-inf"))
        pooled = pooled.scatter_reduce(-1, key_blocks.expand_as(scores), scores, "amax")  # other documents: -inf
        if indexer.local_blocks > 0:
            own = (positions[:, queries, None] // size - local).clamp(min=0)  # [b, tile, local]
            pooled.scatter_(-1, own[:, None].expand(-1, heads, -1, -1), float("inf"))
        best, chosen = pooled.topk(topk, dim=-1)
        picks.append(chosen.masked_fill(best == float("-inf"), -1).to(torch.int32))
    picked = gather_tokens(torch.cat(picks, dim=2).transpose(1, 2).contiguous(), group)  # [b, seq, G, k]
    return (picked if sharding is None else sharding.unshard(picked)).transpose(1, 2)


def block_keep(selection: torch.Tensor, key_blocks: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """``[b, h, rows, seq]`` bool: key ``j`` lies in one of the blocks ``selection`` (``[b, h, rows, k]`` document
    block ids, ``-1`` unused) picks for each query; ``key_blocks`` (``[b, seq]``): each key's block in its document
    (whether it is the query's document and visible is ``document_causal``'s)."""
    picked = torch.zeros(*selection.shape[:3], n_blocks + 1, dtype=torch.bool, device=selection.device)
    picked.scatter_(-1, selection.long().masked_fill(selection < 0, n_blocks), True)
    return torch.stack([row.index_select(-1, blocks) for row, blocks in zip(picked, key_blocks, strict=True)])


def block_selected_attention(
    q, k, v, selection, block_size: int, query_heads: int, first: int, bounds: torch.Tensor, scale: float,
    dropout: float = 0.0, queries: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``[b, n, h, dv]``: this rank's query heads ``first, ..., first + h - 1`` of ``query_heads`` (``q``: ``[b, h, n,
    d]``, the whole sequence or the queries at the whole-sequence positions ``queries``; ``k``, ``v`` the whole
    sequence) over the blocks (of ``block_size`` keys) of their KV groups' ``selection`` (``sp_block_topk``'s), within
    their documents, causally (``dsa.selected_attention``)."""
    _, positions = document_positions(bounds, k.shape[0], k.shape[2], k.device)
    key_blocks = positions // block_size
    n_blocks = int(key_blocks.max()) + 1
    mine = head_selection(selection, query_heads, first, q.shape[1])
    keep = functools.partial(block_keep, key_blocks=key_blocks, n_blocks=n_blocks)
    return selected_attention(q, k, v, mine, bounds, scale, dropout, keep=keep, queries=queries)


def head_selection(selection: torch.Tensor, query_heads: int, first: int, count: int) -> torch.Tensor:
    """The selections (``[b, G, seq, k]``, one per KV group) of the query heads ``first, ..., first + count - 1`` of
    ``query_heads`` (this Ulysses rank's): ``[b, count, seq, k]``."""
    groups = selection.shape[1]
    heads = torch.arange(first, first + count, device=selection.device)
    return selection.index_select(1, heads // (query_heads // groups))
