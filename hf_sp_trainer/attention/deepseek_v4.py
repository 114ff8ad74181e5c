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
forward is this module's: the token K = V and the compressors' per-token inputs are all-gathered (differentiable:
their gradients are reduce-scattered home), every document's windows are compressed from its own first token (each
rank the whole sequence's, redundantly: ``O(seq)``), and this rank's queries attend, in query tiles recomputed in the
backward, to their window and their document's visible entries. Exact as one device on each document alone; the
indexer's top-k as DSA's (ties at the k-th place aside). A ring is refused.
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


def gathered(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[b, seq, ...]`` from every rank's ``[b, s, ...]`` (contiguous shards), the gradient back to each rank."""
    if group is None:
        return x
    parts = all_gather_stack(x.contiguous(), group)  # [P, b, s, ...]
    return parts.transpose(0, 1).flatten(1, 2)


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


def _entries(compressor, hidden, bounds, group, overlap: bool, owner=None, dim: int | None = None) -> Entries:
    owner = owner or compressor
    dim = dim or compressor.head_dim
    rate = compressor.compress_rate
    kv_in, gate_in = gathered(owner.kv_proj(hidden), group), gathered(owner.gate_proj(hidden), group)
    row, start, at, doc = complete_windows(bounds, hidden.shape[0], kv_in.shape[1], rate, hidden.device)
    return Entries(_compress(owner, kv_in, gate_in, row, start, at, rate, dim, overlap), start + rate - 1, doc)


@torch.no_grad()
def _csa_picks(attn, hidden, q_residual, position_ids, bounds, docs, first: int, group) -> torch.Tensor:
    """``[b, s, k]``: the CSA entries the indexer picks for this rank's queries (the top ``index_topk`` of those
    complete before them in their document; ``-1``: none), scored in query tiles."""
    indexer = attn.compressor.indexer
    modeling = sys.modules[type(indexer).__module__]
    entries = _entries(indexer, hidden, bounds, group, True, owner=indexer, dim=indexer.head_dim)
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
    kv_all = gathered(kv.transpose(1, 2), group).transpose(1, 2)  # [b, 1, seq, d]
    first = rank * s
    docs, _ = document_positions(bounds, b, kv_all.shape[2], hidden.device)
    entries = picks = None
    if attn.compressor is not None:
        csa = attn.layer_type == "compressed_sparse_attention"
        entries = _entries(attn.compressor, hidden, bounds, group, overlap=csa)
        if csa:
            picks = _csa_picks(attn, hidden, q_residual, position_ids, bounds, docs, first, group)
    out = _tiled(q, kv_all, entries, picks, docs, first, attn.sliding_window, attn.sinks, attn.scaling)
    out = rope(out, cos, -sin).transpose(1, 2)  # the values' RoPE undone at the query's position
    grouped = attn.o_a_proj(out.reshape(b, s, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped)


def _tiled(q, kv_all, entries, picks, docs, first: int, window: int, sinks, scale: float) -> torch.Tensor:
    """``[b, h, s, d]``: this rank's queries over their window and their entries (all complete ones, or ``picks``),
    in query tiles of at most about ``SCORE_BYTES`` of fp32 logits, each recomputed in the backward (its masks
    too: nothing of ``s x seq`` is kept)."""
    b, h, s, _ = q.shape
    n = 0 if entries is None else (picks.shape[-1] if picks is not None else entries.keys.shape[0])
    tile = max(1, min(s, SCORE_BYTES // (4 * b * h * (window + n + min(s, 1024)))))
    grad = torch.is_grad_enabled() and (q.requires_grad or kv_all.requires_grad)
    parts = () if entries is None else (entries.keys, entries.end, entries.doc)
    outs = []
    for start in range(0, s, tile):
        rows = slice(start, min(s, start + tile))
        fn = functools.partial(_attend, first=first + start, window=window, scale=scale, n_parts=len(parts))
        tile_picks = None if picks is None else picks[:, rows]
        args = (q[:, :, rows], kv_all, docs, sinks, tile_picks, *parts)
        outs.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return torch.cat(outs, dim=2)


def _attend(q, kv_all, docs, sinks, picks, *parts, first: int, window: int, scale: float, n_parts: int):
    """One tile: the queries ``first, first + 1, ...`` over the K = V of their window and their entries."""
    t = q.shape[2]
    queries = torch.arange(first, first + t, device=q.device)
    lo = max(0, first - window + 1)
    at = torch.arange(lo, first + t, device=q.device)
    near = (docs[:, queries, None] == docs[:, None, at]) & (at <= queries[:, None]) & (queries[:, None] - at < window)
    win = kv_all[:, :, lo : first + t]  # [b, 1, k, d]
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
