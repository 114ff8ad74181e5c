"""DeepSeek-V4's attention under SP (a context-parallel split: every rank keeps all heads of its own queries), exact.

Each V4 layer attends a query with one K = V head to the tokens of a sliding window (``sliding_window``, itself
included) and, on its compressed layers, to compressed entries of its document's earlier tokens, with per-head sinks
in the softmax denominator:

- HCA (``heavily_compressed_attention``, rate ``m'``): one entry per complete window of ``m'`` tokens, the softmax-
  gated sum of their compressor values, RMS-normed, RoPE at the window's first position; every complete window
  before the query is attended;
- CSA (``compressed_sparse_attention``, rate ``m``): one entry per window from the previous window's first half of
  the values and this window's second half (``2m`` slots), and a lightning indexer, compressed the same way at
  ``index_head_dim``, picks the top ``index_topk`` complete entries per query (no gradient).

transformers aligns the windows to the row (so its packed forward mixes documents) and drops the entries' mask when
the attention gets none, as SP's registered attention does. Under SP (``mixers.swap``, behaviour-checked) the layer's
forward is this module's, and nothing of the whole sequence's tokens is gathered:

- the token K = V comes with a *left halo*: the ``sliding_window - 1`` tokens before this rank's shard, from the
  previous ranks (``with_left_halo``: every rank's tail all-gathered, ``P x min(s, window - 1)`` tokens);
- each rank compresses the windows that *end* in its shard, counted from their document's first token, from its
  compressor inputs and a halo of ``rate - 1`` tokens (CSA, whose entry also reads the previous window: ``2 rate - 1``),
  and the entries (``seq / rate`` of them) are all-gathered in window order;
- this rank's queries attend, in query tiles recomputed in the backward, to their window and their document's
  visible entries.

Every gather is differentiable (the gradients are reduce-scattered home). Exact as one device on each document alone;
the indexer's top-k as DSA's (ties at the k-th place aside). No head is split, so any sp runs (``validate``:
contiguous shards); a ring is refused.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ..comm.gather import all_gather_stack
from .block_sparse import complete_windows, document_positions, windows_seen
from .dsa import SCORE_BYTES


def with_left_halo(x: torch.Tensor, width: int, group: dist.ProcessGroup | None, rank: int) -> tuple[torch.Tensor, int]:
    """``([b, h + s, ...], first)``: the ``h = min(width, rank * s)`` tokens before this rank's shard (``x``,
    ``[b, s, ...]``, the ``rank``-th contiguous one) and the shard, and the whole-sequence position of the first.
    Every rank's last ``min(s, width)`` tokens are all-gathered (the gradient back to each rank)."""
    s = x.shape[1]
    if group is None or width <= 0 or dist.get_world_size(group) == 1:
        return x, rank * s
    tail = min(s, width)
    tails = all_gather_stack(x[:, s - tail :].contiguous(), group)  # [P, b, tail, ...]
    before = tails[max(0, rank - -(-width // tail)) : rank].transpose(0, 1).flatten(1, 2)
    before = before[:, max(0, before.shape[1] - width) :]
    return torch.cat([before, x], dim=1), rank * s - before.shape[1]


def _has_previous(at: torch.Tensor, rate: int) -> torch.Tensor:
    """Windows that have one before them in their document (CSA's overlap): not the document's first."""
    return at >= rate


def _compress(owner, kv_in, gate_in, row, start, at, rate: int, dim: int, overlap: bool) -> torch.Tensor:
    """``[n, dim]``: the compressor ``owner``'s entries of the windows (``block_sparse.complete_windows``), from the
    whole sequence's per-token ``kv_proj`` / ``gate_proj`` outputs; ``overlap`` (CSA): the previous window's first
    half in front."""
    modeling = sys.modules[type(owner).__module__]
    span = start[:, None] + torch.arange(rate, device=start.device)
    kv = kv_in[row[:, None], span]
    gate = gate_in[row[:, None], span] + owner.position_bias
    if overlap:
        before = (span - rate).clamp(min=0)
        earlier = _has_previous(at, rate)[:, None, None]
        prev_kv = kv_in[row[:, None], before][..., :dim].masked_fill(~earlier, 0.0)
        prev_gate = (gate_in[row[:, None], before] + owner.position_bias)[..., :dim]
        prev_gate = prev_gate.masked_fill(~earlier, float("-inf"))
        kv, gate = torch.cat([prev_kv, kv[..., dim:]], dim=1), torch.cat([prev_gate, gate[..., dim:]], dim=1)
    entries = owner.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
    cos, sin = owner.rotary_emb(entries[None], position_ids=at[None], layer_type="compress")
    return modeling.apply_rotary_pos_emb(entries[None].unsqueeze(1), cos, sin)[0, 0]


@dataclass(frozen=True)
class Entries:
    """A compressor's entries of the whole sequence: ``keys`` ``[n, d]`` and, per entry, its last position and
    document."""

    keys: torch.Tensor
    end: torch.Tensor
    doc: torch.Tensor


def _entries(
    compressor, hidden, bounds, group, rank: int, overlap: bool, owner=None, dim: int | None = None
) -> Entries:
    """The compressor's entries of the whole sequence, in window order: this rank compresses the windows ending in
    its shard (from its inputs and their left halo), the entries are all-gathered (padded to the most any rank has)."""
    owner = owner or compressor
    dim = dim or compressor.head_dim
    rate = compressor.compress_rate
    b, s = hidden.shape[:2]
    world = 1 if group is None else dist.get_world_size(group)
    row, start, at, doc = complete_windows(bounds, b, s * world, rate, hidden.device)
    end = start + rate - 1
    halo = 2 * rate - 1 if overlap else rate - 1
    kv_in, first = with_left_halo(owner.kv_proj(hidden), halo, group, rank)
    gate_in, _ = with_left_halo(owner.gate_proj(hidden), halo, group, rank)
    mine = end // s == rank
    keys = _compress(owner, kv_in, gate_in, row[mine], start[mine] - first, at[mine], rate, dim, overlap)
    if world == 1:
        return Entries(keys, end, doc)
    owners = end // s  # the rank whose shard holds each window's last token, in window order
    count = torch.nn.functional.one_hot(owners, world).cumsum(0)  # [n, P]: windows of each rank so far
    most = int(count[-1].max()) if owners.numel() else 0
    if most == 0:  # no complete window anywhere (every rank knows: the same bounds)
        return Entries(keys, end, doc)
    padded = torch.cat([keys, keys.new_zeros(most - keys.shape[0], keys.shape[1])])
    every = all_gather_stack(padded, group)  # [P, most, d]
    slot = count.gather(1, owners[:, None]).squeeze(1) - 1  # each window's place among its rank's
    return Entries(every[owners, slot], end, doc)


@torch.no_grad()
def _csa_picks(attn, hidden, q_residual, position_ids, bounds, docs, first: int, group) -> torch.Tensor:
    """``[b, s, k]``: the CSA entries the indexer picks for this rank's queries (the top ``index_topk`` of those
    complete before them in their document; ``-1``: none), scored in query tiles."""
    indexer = attn.compressor.indexer
    modeling = sys.modules[type(indexer).__module__]
    entries = _entries(indexer, hidden, bounds, group, first // hidden.shape[1], True, owner=indexer,
                       dim=indexer.head_dim)  # fmt: skip
    b, s = hidden.shape[:2]
    cos, sin = indexer.rotary_emb(hidden, position_ids=position_ids, layer_type="compress")
    q = indexer.q_b_proj(q_residual).view(b, s, -1, indexer.head_dim).transpose(1, 2)
    q = modeling.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # [b, s, H, d]
    n = entries.keys.shape[0]
    keys, top_k = entries.keys[None].expand(b, -1, -1), min(indexer.index_topk, n)
    tile = max(1, SCORE_BYTES // (4 * b * q.shape[2] * max(n, 1)))
    picks = []
    for start in range(0, s, tile):
        rows = slice(start, min(s, start + tile))
        scores = indexer.scorer(q[:, rows], keys, hidden[:, rows])  # [b, t, n]
        seen = windows_seen(
            entries.doc, entries.end, docs, torch.arange(first + start, first + start + scores.shape[1])
        )
        top = scores.masked_fill(~seen, float("-inf")).topk(top_k, dim=-1)
        picks.append(torch.where(top.values.isfinite(), top.indices, -1))
    return torch.cat(picks, dim=1)


def v4_attention_forward(attn, hidden, position_embeddings, position_ids, bounds, group, rank: int) -> torch.Tensor:
    """``DeepseekV4Attention.forward``'s output for this rank's tokens (``hidden`` ``[b, s, h]``, the ``rank``-th
    contiguous shard), as one device computes each document alone."""
    modeling = sys.modules[type(attn).__module__]
    rope = modeling.apply_rotary_pos_emb
    b, s, _ = hidden.shape
    cos, sin = position_embeddings[attn.rope_layer_type]
    q_residual = attn.q_a_norm(attn.q_a_proj(hidden))
    q = rope(attn.q_b_norm(attn.q_b_proj(q_residual).view(b, s, -1, attn.head_dim).transpose(1, 2)), cos, sin)
    kv = rope(attn.kv_norm(attn.kv_proj(hidden)).view(b, s, 1, attn.head_dim).transpose(1, 2), cos, sin)
    kv_near, base = with_left_halo(kv.transpose(1, 2), attn.sliding_window - 1, group, rank)  # [b, halo + s, 1, d]
    kv_near = kv_near.transpose(1, 2)  # [b, 1, halo + s, d]: whole-sequence positions base, base + 1, ...
    first = rank * s
    world = 1 if group is None else dist.get_world_size(group)
    docs, _ = document_positions(bounds, b, s * world, hidden.device)
    entries = picks = None
    if attn.compressor is not None:
        csa = attn.layer_type == "compressed_sparse_attention"
        entries = _entries(attn.compressor, hidden, bounds, group, rank, overlap=csa)
        if csa:
            picks = _csa_picks(attn, hidden, q_residual, position_ids, bounds, docs, first, group)
    out = _tiled(q, kv_near, base, entries, picks, docs, first, attn.sliding_window, attn.sinks, attn.scaling)
    out = rope(out, cos, -sin).transpose(1, 2)  # the values' RoPE undone at the query's position
    grouped = attn.o_a_proj(out.reshape(b, s, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped)


def _tiled(q, kv_near, base: int, entries, picks, docs, first: int, window: int, sinks, scale: float) -> torch.Tensor:
    """``[b, h, s, d]``: this rank's queries over their window (``kv_near``: the K = V of the whole-sequence positions
    ``base, base + 1, ...``) and their entries (all complete ones, or ``picks``), in query tiles of at most about
    ``SCORE_BYTES`` of fp32 logits, each recomputed in the backward (its masks too: nothing of ``s x seq`` is kept)."""
    b, h, s, _ = q.shape
    n = 0 if entries is None else (picks.shape[-1] if picks is not None else entries.keys.shape[0])
    tile = max(1, min(s, SCORE_BYTES // (4 * b * h * (window + n + min(s, 1024)))))
    grad = torch.is_grad_enabled() and (q.requires_grad or kv_near.requires_grad)
    parts = () if entries is None else (entries.keys, entries.end, entries.doc)
    outs = []
    for start in range(0, s, tile):
        rows = slice(start, min(s, start + tile))
        fn = functools.partial(_attend, first=first + start, base=base, window=window, scale=scale, n_parts=len(parts))
        tile_picks = None if picks is None else picks[:, rows]
        args = (q[:, :, rows], kv_near, docs, sinks, tile_picks, *parts)
        outs.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return torch.cat(outs, dim=2)


def _attend(q, kv_near, docs, sinks, picks, *parts, first: int, base: int, window: int, scale: float, n_parts: int):
    """One tile: the queries ``first, first + 1, ...`` over the K = V of their window (``kv_near`` from position
    ``base``) and their entries."""
    t = q.shape[2]
    queries = torch.arange(first, first + t, device=q.device)
    lo = max(0, first - window + 1)
    at = torch.arange(lo, first + t, device=q.device)
    near = (docs[:, queries, None] == docs[:, None, at]) & (at <= queries[:, None]) & (queries[:, None] - at < window)
    win = kv_near[:, :, lo - base : first + t - base]  # [b, 1, k, d]
    logits = [(torch.matmul(q, win.transpose(-1, -2)) * scale).masked_fill(~near[:, None], float("-inf"))]
    keys = None
    if n_parts:
        entries = Entries(*parts)
        if picks is None:  # HCA: every complete entry of the document
            keys, seen = entries.keys, windows_seen(entries.doc, entries.end, docs, queries)
            scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
        else:  # CSA: the indexer's picks
            keys, seen = entries.keys[picks.clamp(min=0)], picks >= 0  # [b, t, k, d]
            scores = torch.einsum("bhtd,btkd->bhtk", q, keys) * scale
        logits.append(scores.masked_fill(~seen[:, None], float("-inf")))
    probs = _softmax_with_sinks(torch.cat(logits, dim=-1), sinks).to(win.dtype)
    out = torch.matmul(probs[..., : win.shape[2]], win)
    if keys is not None:
        rest = probs[..., win.shape[2] :]
        out = out + (torch.matmul(rest, keys) if picks is None else torch.einsum("bhtk,btkd->bhtd", rest, keys))
    return out


def _softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax of ``logits`` ``[b, h, t, k]`` with one more logit per head (its sink) in each denominator."""
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(logits.shape[0], -1, logits.shape[2], 1)
    return torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
