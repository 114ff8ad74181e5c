"""Doge's dynamic-mask attention (``DogeAttention``) under Ulysses SP, exact.

Each kv head of Doge scores every key with a learned bias ``dt = exp(A * softplus(dt_proj(v)))`` (from the values of
all kv heads of the key's token) and ``prepare_dynamic_mask`` builds an additive mask from it: per query, of its
visible keys (causal, and ``config.sliding_window`` where the model's mask applies one) only the ``keep_window_size``
of largest ``dt`` stay (all of them when fewer are visible), each with ``dt`` added to its logit. On one device, for a
document alone, that is what this module computes; transformers' module builds it from the mask of its own row and
hands it to the registered attention, which SP replaces (SP passes no mask).

Under SP (``mixers.swap``, behaviour-checked by ``mixers.doge_checks``) the layer's forward is ``doge_attention_
forward``: its projections, norms, RoPE and ``dt`` on this rank's tokens as installed; one all-to-all over the
Ulysses group gives this rank's heads (kv heads replicated as ``UlyssesAttention`` does) and their ``dt`` over the
whole sequence; in query tiles of bounded memory, recomputed in the backward, each query takes the top
``keep_window_size`` of its *document's* visible keys by ``dt`` and attends them with the bias (``dt`` keeps its
gradient: ``A`` and ``dt_proj`` train); the output goes back by the inverse all-to-all. With a ring, DSA's all-gather
path (``dsa.ring_gather``): the ring group's K, V and ``dt`` gathered in sequence order, this rank's zigzag portion
of the queries attending to them at their whole-sequence positions.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ..comm import all_to_all, all_to_all_many
from ..model.mixers import mask_only_window
from .dsa import SCORE_BYTES, document_causal, document_ids, ring_gather
from .ring import autocast_like_sdpa
from .ulysses import kv_replication


def doge_projection(attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings):
    """``DogeAttention.forward``'s queries ``[b, h, s, d]``, keys and values ``[b, kv, s, d]`` (normed, RoPE'd) and
    ``dt`` ``[b, kv, s]``, of the tokens ``hidden_states`` (no cache)."""
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    b, s, _ = hidden_states.shape
    shape = (b, s, -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(hidden_states).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(hidden_states).view(shape)).transpose(1, 2)
    v = attn.v_proj(hidden_states).view(shape).transpose(1, 2)
    q, k = rope(q, k, *position_embeddings)
    dt = attn.dt_proj(v.transpose(1, 2).reshape(b, s, -1))
    dt = torch.exp(attn.A * torch.nn.functional.softplus(dt)).transpose(-1, -2)
    return q, k, v, dt


def doge_attention_forward(
    attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, bounds: torch.Tensor, group, ring=None
) -> torch.Tensor:
    """``DogeAttention.forward``'s output ``[b, s, hidden]`` for this rank's tokens (its shard of the sequence over
    the Ulysses ``group``; ``None``: the whole sequence in one process), as one device computes each document of
    ``bounds`` alone. ``ring``: ``(ring group, ring rank, zigzag order)`` with a ring, else ``None``."""
    b, s, _ = hidden_states.shape
    q, k, v, dt = doge_projection(attn, hidden_states, position_embeddings)
    world = 1 if group is None else dist.get_world_size(group)
    rep = kv_replication(k.shape[1], world)
    if rep > 1:  # e.g. 2 kv heads on 4 ranks: each rank needs its query heads' kv head (and its dt)
        k, v, dt = (t.repeat_interleave(rep, dim=1) for t in (k, v, dt))
    q, k, v = autocast_like_sdpa(q, k, v)
    if world > 1:  # [b, heads / U, seq, ...]: this rank's heads over the whole sequence
        q, k, v, dt = all_to_all_many((q, k, v, dt[..., None]), scatter_dim=1, gather_dim=2, group=group)
        dt = dt[..., 0]
    queries = None
    if ring is not None:  # this rank's heads over its ring portion: the ring group's K, V, dt gathered
        (k, v, dt), queries = ring_gather((k, v, dt[..., None]), *ring)
        dt = dt[..., 0]
    window = mask_only_window(attn, attn.config)  # the model's mask's (``create_sliding_window_causal_mask``)
    out = dynamic_mask_attention(q, k, v, dt, bounds, attn.scaling, attn.keep_window_size, window, queries)
    if world > 1:
        out = all_to_all(out, scatter_dim=1, gather_dim=2, group=group)  # [b, s, h, d]
    return attn.o_proj(out.reshape(b, s, -1).contiguous())


def dynamic_mask_attention(
    q, k, v, dt, bounds, scale: float, keep: int, window: int | None, queries: torch.Tensor | None = None
) -> torch.Tensor:
    """``[b, n, h, d]``: each query of ``q`` (``[b, h, n, d]``: the whole sequence, or those at the whole-sequence
    positions ``queries``) over the ``keep`` keys of largest ``dt`` (``[b, kv, seq]``) among its visible ones (its
    document's, causal, within ``window``), ``dt`` added to their logits; ``k``, ``v`` ``[b, kv, seq, d]`` (the whole
    sequence; ``h`` a multiple of ``kv``). Query tiles of at most ``SCORE_BYTES`` of fp32 logits, each recomputed in
    the backward."""
    b, h, n, _ = q.shape
    seq = k.shape[2]
    queries = torch.arange(seq, device=q.device) if queries is None else queries
    docs = document_ids(bounds, b, seq, q.device)
    tile = max(1, SCORE_BYTES // (4 * b * h * seq))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, dt))
    outs = []
    for start in range(0, n, tile):
        rows = slice(start, min(n, start + tile))
        fn = functools.partial(_attend_tile, scale=scale, keep=keep, window=window)
        args = (q[:, :, rows], k, v, dt, docs, queries[rows])
        outs.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return torch.cat(outs, dim=2).transpose(1, 2)


def visible_keys(docs: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[b, t, seq]`` bool: the keys each query (whole-sequence positions ``queries``) sees on one device with its
    document alone: its document's, causal, and within the ``window`` (transformers': ``query - key < window``)."""
    visible = document_causal(docs, queries)
    if window:
        keys = torch.arange(docs.shape[1], device=docs.device)
        visible = visible & (queries[:, None] - keys[None] < window)
    return visible


def dynamic_selection(dt: torch.Tensor, visible: torch.Tensor, keep: int) -> torch.Tensor:
    """``[b, kv, t, seq]`` bool: per query and kv head, the ``keep`` visible keys of largest ``dt`` (``[b, kv, seq]``;
    every visible key where fewer are)."""
    scores = dt[:, :, None, :].masked_fill(~visible[:, None], float("-inf"))
    top = scores.topk(min(keep, scores.shape[-1]), dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & visible[:, None]


def dynamic_bias(dt: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``[b, kv, t, seq]``: the additive mask, ``dt`` on the selected keys, ``-inf`` elsewhere."""
    return dt[:, :, None, :].masked_fill(~selected, float("-inf"))


def _attend_tile(q, k, v, dt, docs, queries, scale: float, keep: int, window: int | None) -> torch.Tensor:
    """``[b, h, t, d]``: the queries at the whole-sequence positions ``queries`` over their selected keys, as eager
    attention (query head ``i`` on kv head ``i // (h / kv)``, as ``repeat_kv``)."""
    b, h, t, d = q.shape
    bias = dynamic_bias(dt, dynamic_selection(dt.detach(), visible_keys(docs, queries, window), keep))
    q = q.view(b, k.shape[1], h // k.shape[1], t, d)  # query heads grouped by kv head: k, v, bias broadcast
    logits = torch.matmul(q, k[:, :, None].transpose(-1, -2)) * scale + bias[:, :, None]  # dt's dtype, as transformers
    probs = logits.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v[:, :, None]).view(b, h, t, -1)


__all__ = ["doge_attention_forward", "doge_projection", "dynamic_mask_attention"]
