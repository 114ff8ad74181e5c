"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5, AXK2, Dots3-Note, Mistral-Large-4; HY-V4's parts) under
Ulysses SP, exact.

DSA attends each query to the top-k keys of its document's causal prefix, chosen by a lightning indexer: one shared
key per token, ``score(i, j) = sum_h w_h(i) relu(q_h(i) . k(j) / sqrt(d))`` in fp32, no gradient. transformers'
attention slices a mask SP doesn't pass (SP's attention key gets none) and its indexer would score this rank's
queries against this rank's keys only. Under SP (both swapped by ``mixers.swap``, behaviour-checked):

1. the attention's forward runs as installed, given a zero-byte placeholder mask (``placeholder_mask``);
2. its indexer (``sp_index_topk``) gathers the indexer keys (one ``index_head_dim`` vector per token) over the SP
   group and scores this rank's queries against every key of their document's causal prefix, in query tiles of
   bounded memory; the top-k of each query, as positions of the whole sequence, are all-gathered (``[b, s, k]``
   int32) and returned; transformers then hands them to SP's attention as ``indices=``, as it does for its own
   non-eager kernels (and a layer that shares the previous layer's selection reuses them as they are);
3. SP's Ulysses attention attends each query of its heads to its selected keys within its document
   (``selected_attention``, in query tiles recomputed in the backward).

Exact when the top-k picks the same keys as one device: the scores are the same fp32 products, so only keys tied at
the k-th place (to round-off, or exactly: a zero relu sum) can differ, as they can between two lengths on one
device. ``selected_attention`` scores every key and masks the unselected ones (``O(s^2)`` work, memory bounded by
its tiles); on rows long against the top-k (``gathered_keys.GATHER_ABOVE``) it gathers each query's selected keys
instead (``O(s k)`` work), in tiles too.

With a ring (``ring_size > 1``: sp = ulysses x ring, the heads not divisible by sp) the Ulysses all-to-all leaves a
rank its heads over its zigzag ring portion; the all-gather path (``ring_gather``) gathers the ring group's K/V in
sequence order (one collective; their gradients reduce-scattered home), and ``selected_attention`` attends this
rank's queries, at their whole-sequence positions, to them: the K/V of ``heads / ulysses`` heads of the whole
sequence per rank (``ring`` times Ulysses' alone), the selections as without a ring.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..comm import all_gather_along, all_gather_stack
from ..sharding.sequence import SequenceSharding
from .gathered_keys import attend_gathered_tile, gathered_tile_rows, gathers, head_rows

INDICES_KWARG = "indices"  # how transformers' DSA attention hands its top-k to a non-eager kernel
SCORE_BYTES = 1 << 28  # fp32 scores (queries x heads x keys) per query tile, in the indexer and the attention


def document_ids(bounds: torch.Tensor, rows: int, seq: int, device) -> torch.Tensor:
    """``[rows, seq]``: each position's document, from ``bounds``, the documents' starts over the rows laid end to end
    (``documents.document_bounds``)."""
    flat = torch.arange(rows * seq, device=device).view(rows, seq)
    return torch.searchsorted(bounds.to(device), flat, right=True)


def document_causal(docs: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``[rows, len(queries), seq]``: key ``j`` visible to the query at whole-sequence position ``i`` (same document
    in ``docs``, ``document_ids``' ``[rows, seq]``, and ``j <= i``)."""
    keys = torch.arange(docs.shape[1], device=docs.device)
    return (docs[:, queries, None] == docs[:, None, :]) & (keys <= queries[:, None])


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[b, seq, ...]`` from every rank's ``[b, s, ...]`` (contiguous shards; no autograd), for the selections."""
    return x if group is None else all_gather_along(x, dim=1, group=group)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, sharding: SequenceSharding | None):
    """``[b, seq, ...]`` in sequence order from every rank's ``[b, s, ...]`` shard (no autograd); ``sharding``:
    the zigzag one of a ring, ``None`` for contiguous shards."""
    gathered = gather_tokens(x, group)
    return gathered if sharding is None else sharding.unshard(gathered)


def local_positions(s: int, rank: int, sharding: SequenceSharding | None, device) -> torch.Tensor:
    """The whole-sequence positions of the ``s`` tokens of SP rank ``rank`` (contiguous without ``sharding``)."""
    if sharding is None:
        return torch.arange(rank * s, (rank + 1) * s, device=device)
    return sharding.positions(s * sharding.sp_size, rank).to(device)


def ring_gather(
    tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup, ring_rank: int, order: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The all-gather path of a ring: from this rank's ``tensors`` (``[b, h, n, d_i]``, ring rank ``ring_rank``'s
    portion of the zigzag ``order``: K, V, a per-key bias) those of the whole sequence in sequence order, gathered in
    one collective (one per dtype) with their gradients reduce-scattered back, and the whole-sequence positions of
    this rank's ``n`` queries."""
    n, order = tensors[0].shape[2], order.to(tensors[0].device)
    inverse = torch.argsort(order)
    by_dtype = [tensors] if len({t.dtype for t in tensors}) == 1 else [(t,) for t in tensors]
    whole = []
    for same in by_dtype:
        stacked = all_gather_stack(torch.cat(same, dim=-1), group)  # [R, b, h, n, sum d]
        ring, b, h = stacked.shape[:3]
        gathered = stacked.permute(1, 2, 0, 3, 4).reshape(b, h, ring * n, -1).index_select(2, inverse)
        whole += gathered.split([t.shape[-1] for t in same], dim=-1)
    return whole, order[ring_rank * n : (ring_rank + 1) * n]


def v32_projection(indexer: torch.nn.Module, hidden_states, q_resid, position_embeddings, rope: str | Callable):
    """``DeepseekV32Indexer.forward``'s queries ``[b, s, H, D]``, keys ``[b, s, D]``, head weights ``[b, s, H]`` (fp32)
    and the scale of the scores (``None``: unscaled), with ``rope`` (its modeling module's RoPE function, or its
    name) on the first ``qk_rope_head_dim`` dims of both: V3.2's and AXK2's non-interleaved one, GLM-5's interleaved
    one."""
    rope = getattr(sys.modules[type(indexer).__module__], rope) if isinstance(rope, str) else rope
    b, s, _ = hidden_states.shape
    heads, dim, rot = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(b, s, heads, dim)
    q_rot, q_pass = torch.split(q, [rot, dim - rot], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rot, dim - rot], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    keys = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * heads**-0.5
    return torch.cat([q_rot, q_pass], dim=-1).float(), keys, weights, indexer.softmax_scale


def hy_v4_projection(indexer: torch.nn.Module, hidden_states, q_resid, position_embeddings):
    """``HYV4Indexer.forward``'s (and ``HYV4VLIndexer``'s: its module's RoPE, interleaved): RoPE on the *last*
    ``qk_rope_head_dim`` dims, the key norm in its own (fp32) dtype, the softmax scale folded into the head weights (so
    the scores are scaled by 1); the RoPE function its forward calls (transformers 5.25 made HY-V4's interleaved)."""
    rope = getattr(sys.modules[type(indexer).__module__], _rope_called(type(indexer)))
    b, s, _ = hidden_states.shape
    heads, dim, rot = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(b, s, heads, dim)
    q_pass, q_rot = torch.split(q, [dim - rot, rot], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states).to(indexer.k_norm.weight.dtype)).to(hidden_states.dtype)
    k_pass, k_rot = torch.split(k.unsqueeze(2), [dim - rot, rot], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    keys = torch.cat([k_pass, k_rot], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    weights = weights * heads**-0.5 * indexer.softmax_scale
    return torch.cat([q_pass, q_rot], dim=-1).float(), keys, weights, None


@functools.cache
def _rope_called(cls: type) -> str:
    """The ``apply_rotary_pos_emb*`` function ``cls.forward`` calls (its modeling module's)."""
    called = re.findall(r"\b(apply_rotary_pos_emb\w*)\(", inspect.getsource(cls.forward))
    if len(set(called)) != 1:
        raise ValueError(f"{cls.__qualname__}.forward calls {sorted(set(called))}, not one RoPE function")
    return called[0]


# Each SP-run indexer class: its projection (queries, keys, head weights) as its forward computes them
PROJECTIONS: dict[str, Callable] = {
    "DeepseekV32Indexer": functools.partial(v32_projection, rope="apply_rotary_pos_emb"),
    "GlmMoeDsaIndexer": functools.partial(v32_projection, rope="apply_rotary_pos_emb_interleave"),
    "AXK2Indexer": functools.partial(v32_projection, rope="apply_rotary_pos_emb"),
    "Dots3NoteTextIndexer": functools.partial(v32_projection, rope="apply_rotary_pos_emb_interleave"),
    "HYV4Indexer": hy_v4_projection,
    "HYV4VLIndexer": hy_v4_projection,
}


def mistral_large4_projection(indexer: torch.nn.Module, hidden_states, position_embeddings, position_ids):
    """``MistralLarge4TextIndexer.forward``'s: queries from the hidden states (``q_input_norm``, ``wq_b``; no
    ``q_resid``), scaled per head by ``scale * log(position + 1) + bias`` at each token's position in its document
    (``position_ids``: SP's document-relative positions of this rank's tokens), interleaved RoPE on the first
    ``qk_rope_head_dim`` dims on its RoPE layers only (``use_rope``; its ``no_rope_layers`` entry)."""
    rope = sys.modules[type(indexer).__module__].apply_rotary_pos_emb_interleave
    b, s, _ = hidden_states.shape
    heads, dim, rot = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q = indexer.wq_b(indexer.q_input_norm(hidden_states)).view(b, s, heads, dim)
    q = indexer.softmax_scaling(q, position_ids, head_dim_first=False)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    if indexer.use_rope:
        cos, sin = position_embeddings
        q_rot, q_pass = torch.split(q, [rot, dim - rot], dim=-1)
        k_rot, k_pass = torch.split(k, [rot, dim - rot], dim=-1)
        q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * heads**-0.5
    return q.float(), k.squeeze(2), weights, indexer.softmax_scale


# Indexers called ``(hidden_states, position_embeddings, attention_mask, position_ids, cache)`` (no ``q_resid``):
# their projection from the hidden states, the embeddings and this rank's document positions
POSITIONAL_PROJECTIONS: dict[str, Callable] = {"MistralLarge4TextIndexer": mistral_large4_projection}


@torch.no_grad()
def sp_index_topk(
    indexer: torch.nn.Module,
    projected: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bounds: torch.Tensor,
    group: dist.ProcessGroup | None,
    rank: int,
    sharding: SequenceSharding | None = None,
) -> torch.Tensor:
    """``[b, seq, k]`` int32: for every query of the whole sequence (in sequence order), the whole-sequence positions
    of its top-k keys among its document's causal prefix (positions past its visible keys are masked by
    ``selected_attention``). ``projected``: SP rank ``rank``'s queries, keys, head weights and score scale (a
    ``PROJECTIONS`` entry), its shard of the ``sharding`` (a ring's zigzag one; ``None``: contiguous shards); the
    keys and the selections are gathered over ``group``."""
    q, keys, weights, scale = projected
    b, s, heads, _ = q.shape
    keys = gather_sequence(keys.contiguous(), group, sharding).float()  # [b, seq, d]
    seq = keys.shape[1]
    topk = min(indexer.index_topk, seq)
    docs = document_ids(bounds, b, seq, q.device)
    positions = local_positions(s, rank, sharding, q.device)
    picks = []
    if 4 * heads * seq * b > SCORE_BYTES:  # one query's scores over the sequence exceed the budget: stream the keys
        chunk = max(1, SCORE_BYTES // (4 * heads * b))
        for i in range(s):
            row = slice(i, i + 1)
            picks.append(_streamed_topk(q[:, row], keys, weights[:, row], scale, docs, int(positions[i]), topk, chunk))
    else:
        tile = SCORE_BYTES // (4 * heads * seq * b)
        for start in range(0, s, tile):
            rows = slice(start, min(s, start + tile))
            index = _index_scores(q[:, rows], keys, weights[:, rows], scale)  # [b, tile, seq]
            index = index.masked_fill(~document_causal(docs, positions[rows]), float("-inf"))
            picks.append(index.topk(topk, dim=-1).indices.to(torch.int32))
    return gather_sequence(torch.cat(picks, dim=1), group, sharding)


def _index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale) -> torch.Tensor:
    """``[b, rows, n]``: the indexer's fp32 scores of the queries ``q`` (``[b, rows, heads, d]``, head weights
    ``weights`` ``[b, rows, heads]``) for the keys ``keys`` (``[b, n, d]``)."""
    scores = torch.matmul(q, keys.transpose(-1, -2).unsqueeze(1))
    scores = F.relu(scores if scale is None else scores * scale)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def _streamed_topk(q, keys, weights, scale, docs: torch.Tensor, query: int, topk: int, chunk: int) -> torch.Tensor:
    """``[b, 1, topk]`` int32: the top-k of one query (``q`` ``[b, 1, heads, d]``, at the whole-sequence position
    ``query``) over the keys ``0..query`` in chunks of ``chunk`` keys, each merged into the running top-k (the
    scores of a chunk at a time in memory): the picks of one pass over the whole row, keys of another document
    scoring ``-inf`` as there; a prefix shorter than ``topk`` is completed with later (invisible) positions."""
    b = q.shape[0]
    best = torch.full((b, 1, 0), float("-inf"), device=q.device)
    where = torch.zeros((b, 1, 0), dtype=torch.long, device=q.device)
    for start in range(0, query + 1, chunk):
        cols = torch.arange(start, min(query + 1, start + chunk), device=q.device)
        index = _index_scores(q, keys[:, start : start + len(cols)], weights, scale)  # [b, 1, chunk]
        index = index.masked_fill((docs[:, cols] != docs[:, query : query + 1]).unsqueeze(1), float("-inf"))
        best, order = torch.cat([best, index], dim=-1).topk(min(topk, best.shape[-1] + len(cols)), dim=-1)
        where = torch.cat([where, cols.expand(b, 1, -1)], dim=-1).gather(-1, order)
    later = torch.arange(query + 1, query + 1 + topk - where.shape[-1], device=q.device)
    return torch.cat([where, later.expand(b, 1, -1)], dim=-1).to(torch.int32)


def placeholder_mask(hidden_states: torch.Tensor, seq: int) -> torch.Tensor:
    """``[b, 1, s_local, seq]`` all True without memory (one element, expanded): what the DSA attention slices for
    its indexer, whose SP version reads the documents instead."""
    b, s = hidden_states.shape[:2]
    return torch.ones((), dtype=torch.bool, device=hidden_states.device).expand(b, 1, s, seq)


def selected_attention(
    q,
    k,
    v,
    selection: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    dropout: float = 0.0,
    sinks=None,
    keep=None,
    queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[b, n, h, dv]``: each query of ``q`` (``[b, h, n, d]``; the whole sequence, or those at the whole-sequence
    positions ``queries``) attends to the keys (``k``, ``v``: the whole sequence) its ``selection`` picks that are
    visible to it (its document, causal). ``selection``: one row per query of the whole sequence along its dim -2,
    made a key mask (``[b, 1 or h, rows, seq]`` bool) by ``keep``; by default DSA's top-k whole-sequence positions
    (``[b, seq, k]``, ``selected_positions``). ``sinks`` (``[h]``, HY-V4's): one extra logit per head in each
    softmax's denominator, attending to nothing. Computed in query tiles of at most ``SCORE_BYTES``, each recomputed
    in the backward: every key is scored and the unselected ones masked (``O(n seq)`` work, memory ``O(b h tile
    seq)``), or, for DSA's top-k positions on a sequence of at least ``GATHER_ABOVE`` times the top-k and without
    dropout, the keys they pick are gathered (``gathered_keys``: ``O(n k)`` work)."""
    if sinks is not None and dropout:
        raise ValueError("DSA with attention sinks under SP has no attention dropout; set attention_dropout=0.")
    b, h, n, _ = q.shape
    seq = k.shape[2]
    if queries is None:
        queries = torch.arange(seq, device=q.device)
    else:
        selection = selection.index_select(-2, queries.to(selection.device))
    docs = document_ids(bounds, b, seq, q.device)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if keep is None and not dropout and gathers(selection.shape[-1], seq):  # DSA's top-k: the sparse kernel
        dk, dv, size = k.shape[-1], v.shape[-1], k.element_size()
        tile = gathered_tile_rows(SCORE_BYTES, b, h, k.shape[1], selection.shape[-1], dk, dv, size)
        attend = functools.partial(attend_gathered_tile, scale=scale, kv_heads=k.shape[1])
        keys = (head_rows(k), head_rows(v))
    else:
        tile = max(1, SCORE_BYTES // (4 * b * h * seq))
        keep = keep or functools.partial(selected_positions, seq=seq)
        attend = functools.partial(_attend_tile, scale=scale, dropout=dropout, keep=keep)
        keys = (k, v)
    outs = []
    for start in range(0, n, tile):
        rows = slice(start, min(n, start + tile))
        args = (q[:, :, rows], *keys, selection[..., rows, :], docs, sinks, queries[rows])
        outs.append(checkpoint(attend, *args, use_reentrant=False) if grad else attend(*args))
    return torch.cat(outs, dim=1)


def selected_positions(indices: torch.Tensor, seq: int) -> torch.Tensor:
    """``[b, 1, rows, seq]`` bool: the keys at the whole-sequence positions ``indices`` (``[b, rows, k]``) picks; a
    ``-1`` picks nothing (GLM-5-Next pads its selections with it)."""
    b, rows, _ = indices.shape
    safe = indices.long().masked_fill(indices < 0, seq)  # into a column dropped below
    picked = torch.zeros(b, rows, seq + 1, dtype=torch.bool, device=indices.device).scatter_(-1, safe, True)
    return picked[:, None, :, :seq]


def _attend_tile(q, k, v, selection, docs, sinks, queries, scale: float, dropout: float, keep) -> torch.Tensor:
    """``[b, tile, h, dv]``: the queries at the whole-sequence positions ``queries`` over their selected visible
    keys."""
    b, _, rows, _ = q.shape
    visible = keep(selection) & document_causal(docs, queries)[:, None]
    if sinks is None:
        gqa = k.shape[1] != q.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    logits = (torch.matmul(q, k.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(b, -1, rows, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v).transpose(1, 2)
