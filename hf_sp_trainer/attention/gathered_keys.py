"""The sparse kernel of DSA's selected-keys attention: each query attends to the keys it selected, gathered.

``dsa.selected_attention``'s dense kernel scores every key of the sequence and masks the unselected ones: ``O(n seq)``
work per head however small the top-k. Here each query tile gathers the K / V rows its queries selected
(``[b, kv_heads, tile, k, d]``) and takes the softmax over those alone: ``O(n k)`` work. The tiles are recomputed in
the backward (the gathered rows are not kept), so no step holds the selected keys of all queries at once. The same
keys enter the same softmax, summed in sequence order, as in the dense kernel: equal to round-off
(``tests/test_dsa.py``). Plain torch, CPU and CUDA alike.

Gathering moves ``k (dk + dv)`` values per query and kv head where the dense kernel computes over ``seq`` keys, so it
pays only on long rows: measured on CPU (``scripts/bench_dsa_kernel.py``, fp32, MLA head dims, top-128) it breaks
even near ``seq = 75 k`` and is 1.5x faster at ``128 k`` with half the peak; hence ``GATHER_ABOVE``. On a GPU the
crossover is not measured yet (``scripts/gpu_check.py``'s ``j_dsa_kernel``). No installable sparse kernel with a
backward takes the per-head K / V SP's attention receives: FlashMLA's sparse kernels are forward-only, and
flash-attn 4's sparse MLA backward (SM100) takes MLA's absorbed latent form (one 576-d key shared by all heads).
"""

from __future__ import annotations

import os

import torch

# gather when the sequence holds at least this many times the top-k keys (CPU break-even near 75: module docstring)
GATHER_ABOVE = 80
GATHER_ABOVE_ENV = "HF_SP_DSA_GATHER_ABOVE"  # overrides it, e.g. with a GPU's own crossover (0: always gather)
LOGITS_AT_LEAST = torch.float32  # the logits' operands widened to at least this (as fused kernels keep fp32 scores)


def gathers(topk: int, seq: int) -> bool:
    """Whether selections of ``topk`` keys of a ``seq``-key sequence take the gathered kernel."""
    value = os.environ.get(GATHER_ABOVE_ENV)
    if value is None:
        return seq >= GATHER_ABOVE * topk
    try:
        return seq >= float(value) * topk
    except ValueError:
        raise ValueError(
            f"{GATHER_ABOVE_ENV}={value!r} is not a number: set it to how many times the top-k a row must hold for "
            f"DSA to gather its selected keys (0: always, a large number: never; default {GATHER_ABOVE})."
        ) from None


def gathered_tile_rows(budget: int, b: int, h: int, kv_heads: int, topk: int, dk: int, dv: int, itemsize: int) -> int:
    """Queries per tile so that one tile's gathered K / V rows (and the keys' fp32 copy for half-precision inputs)
    and its fp32 logits and probabilities (the latter twice: the softmax and its mask) stay within ``budget``
    bytes."""
    widened = kv_heads * dk * 4 if itemsize < 4 else 0  # the gathered keys' fp32 copy for the logits
    per_query = b * topk * (kv_heads * (dk + dv) * itemsize + widened + 3 * 4 * h)
    return max(1, budget // per_query)


def head_rows(x: torch.Tensor) -> torch.Tensor:
    """``[b * kv_heads * seq, d]``: one row per kv head and token (``x``: ``[b, kv_heads, seq, d]``; a view where it
    is contiguous), made once per call: a tile gathers its picks with one ``index_select`` (whose backward adds
    their gradients into one such table)."""
    return x.reshape(-1, x.shape[-1])


def attend_gathered_tile(
    q: torch.Tensor,
    key_rows: torch.Tensor,
    value_rows: torch.Tensor,
    picks: torch.Tensor,
    docs: torch.Tensor,
    sinks: torch.Tensor | None,
    queries: torch.Tensor,
    scale: float,
    kv_heads: int,
) -> torch.Tensor:
    """``[b, tile, h, dv]``: the queries ``q`` (``[b, h, tile, dk]``, at the whole-sequence positions ``queries``)
    over the keys ``picks`` (``[b, tile, topk]`` whole-sequence positions, ``-1``: none) selected that they see (their
    document in ``docs``, ``[b, seq]``; causal; a position picked twice counts once, as in a key mask).
    ``key_rows``, ``value_rows``: the whole sequence's K / V (``head_rows``); ``sinks`` (``[h]``): one extra logit
    per head in each softmax's denominator. The logits (of operands widened to fp32 at least) and the softmax in
    fp32, the probabilities then in the values' dtype, as the fused kernels. A query with no visible pick gets
    zeros (the dense kernel's is undefined; DSA's queries always select themselves)."""
    b, h, tile, dk = q.shape
    seq, group = docs.shape[1], h // kv_heads
    positions = picks.long().sort(dim=-1).values  # in sequence order, as the dense kernel sums them
    repeated = torch.zeros_like(positions, dtype=torch.bool)
    repeated[..., 1:] = positions[..., 1:] == positions[..., :-1]
    seen = (positions >= 0) & (positions <= queries.view(1, tile, 1)) & ~repeated
    positions = positions.clamp(min=0)
    seen &= docs.gather(1, positions.view(b, -1)).view_as(positions) == docs[:, queries].unsqueeze(-1)
    heads = torch.arange(b * kv_heads, device=q.device).view(b, kv_heads, 1, 1) * seq  # each (row, kv head)'s table
    rows = (heads + positions.unsqueeze(1)).view(-1)  # [b, kv_heads, tile, topk]
    topk = positions.shape[-1]
    keys = key_rows.index_select(0, rows).view(-1, topk, dk)  # [b kv_heads tile, topk, dk]
    values = value_rows.index_select(0, rows).view(-1, topk, value_rows.shape[-1])
    grouped = q.view(b, kv_heads, group, tile, dk).transpose(2, 3).reshape(-1, group, dk)
    wide = torch.promote_types(q.dtype, LOGITS_AT_LEAST)  # fp32 logits from bf16 operands
    logits = torch.bmm(grouped.to(wide), keys.to(wide).transpose(1, 2)) * scale  # [b kv_heads tile, group, topk]
    mask = seen.unsqueeze(1).expand(b, kv_heads, tile, topk).reshape(-1, 1, topk)
    none_seen = ~mask.any(-1, keepdim=True)
    logits = logits.masked_fill(~mask, float("-inf")).masked_fill(none_seen, 0.0)
    if sinks is None:
        probs = logits.softmax(-1)
    else:
        sink = sinks.to(logits.dtype).view(1, kv_heads, 1, group, 1).expand(b, -1, tile, -1, 1)
        probs = torch.cat([logits, sink.reshape(-1, group, 1)], dim=-1).softmax(-1)[..., :-1]
    probs = probs.masked_fill(none_seen, 0.0).to(values.dtype)
    out = torch.bmm(probs, values).view(b, kv_heads, tile, group, -1)  # [.., tile, group, dv]
    return out.permute(0, 2, 1, 3, 4).reshape(b, tile, h, -1)
