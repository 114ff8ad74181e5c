"""The search on top of the memory model (``memory_model.estimate``): the longest length that fits a budget,
``checkpoint_policy="auto"``'s plan at a length, and the table of ``STACKS`` x sp x ZeRO stage."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from ..memory.keep_budget import exchange_kept_bytes, sequence_aware_kept_bytes
from ..topology import split_sp_size
from .memory_model import MAX_LENGTH, OFFLOAD_IN_FLIGHT, ModelShape, Setting, estimate
from .sparse import check_setting


def granularity(m: ModelShape, s: Setting) -> int:
    """Lengths are searched in multiples of this (1024 tokens, and what the sharding needs: 2 x sp with a ring)."""
    _, ring = split_sp_size(s.sp, m.heads, s.ring)
    return math.lcm(1024, s.sp * (2 if ring > 1 else 1))


def longest_length(m: ModelShape, s: Setting, budget_bytes: float) -> int:
    """The longest length (a multiple of ``granularity``) whose predicted peak fits ``budget_bytes``; 0: none fits,
    ``MAX_LENGTH`` or more: at least that. The peak grows with the length, so this is a bisection."""
    step = granularity(m, s)
    if estimate(m, s, step).peak > budget_bytes:
        return 0
    lo, hi = 1, 2
    while hi * step <= MAX_LENGTH and estimate(m, s, hi * step).peak <= budget_bytes:
        lo, hi = hi, hi * 2
    if hi * step > MAX_LENGTH:
        return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if estimate(m, s, mid * step).peak <= budget_bytes else (lo, mid)
    return lo * step


class AutoKeep(NamedTuple):
    """``checkpoint_policy="auto"``'s plan for one length: layers keeping their attention outputs, those of them
    keeping their all-to-all results too, the predicted peak, and the layers offloading their checkpointed inputs
    (below full checkpointing, CUDA)."""

    kept_layers: int
    kept_exchanges: int
    peak: float
    offloaded_layers: int = 0


def auto_kept_layers(m: ModelShape, s: Setting, length: int, budget_bytes: float) -> AutoKeep:
    """``checkpoint_policy="auto"`` with ``checkpoint_memory_budget=budget_bytes`` at ``length``. ``s`` with full
    checkpointing is where auto starts; each kept layer adds what ``sequence_aware`` keeps in it, while the peak stays
    within the budget; once every attention layer keeps that, layers keep their all-to-all results too (Ulysses
    only), as many as the rest holds (``memory.keep_budget``). Where full checkpointing itself exceeds the budget (on
    CUDA, without ``offload``, which offloads every layer), the first layers offload their checkpointed inputs, as
    many as cover the excess plus the ``OFFLOAD_IN_FLIGHT`` layers being copied (the correction auto learns from its
    measured peaks); the peak is then full checkpointing's less the offloaded checkpoints not in flight."""
    check_setting(m, s, auto=True)
    full = estimate(m, replace(s, checkpointing="full"), length)
    ulysses, ring = split_sp_size(s.sp, m.heads, s.ring)
    b = 2 if s.dtype == "bf16" else 4
    if full.peak > budget_bytes and s.device != "cpu" and not s.offload:
        checkpoint = m.hidden * b * full.local_tokens  # a layer's input (memory.checkpointing: offload_bytes)
        offloaded = min(m.layers, math.ceil((full.peak - budget_bytes) / checkpoint) + OFFLOAD_IN_FLIGHT)
        return AutoKeep(0, 0, full.peak - max(0, offloaded - OFFLOAD_IN_FLIGHT) * checkpoint, offloaded)
    per_layer = sequence_aware_kept_bytes(full.local_tokens, m.q_dim, b, ring)
    kept = 0 if per_layer <= 0 else int(max(0.0, budget_bytes - full.peak) // per_layer)
    kept = min(kept, m.attention_layers)
    peak = full.peak + kept * per_layer
    exchanges = 0
    if ulysses > 1 and kept == m.attention_layers:
        kv = math.lcm(m.kv_heads, ulysses) * m.head_dim  # after replication for the exchange
        per_exchange = exchange_kept_bytes(full.local_tokens, m.q_dim, kv, b)
        exchanges = min(m.attention_layers, int(max(0.0, budget_bytes - peak) // per_exchange))
        peak += exchanges * per_exchange
    return AutoKeep(kept, exchanges, peak)


# The memory-stack combinations of the planner's table (Setting fields), each row adding one feature; the last row is
# everything with checkpoint_policy="sequence_aware" (which keeps the attention kernels' outputs).
STACKS: dict[str, dict] = {
    "no checkpointing": {"checkpointing": "none"},
    "checkpointing": {"checkpointing": "full"},
    "+ fused loss": {"checkpointing": "full", "fused_loss": True},
    "+ tiled MLP": {"checkpointing": "full", "fused_loss": True, "tiled_mlp": True},
    "+ activation offload": {"checkpointing": "full", "fused_loss": True, "tiled_mlp": True, "offload": True},
    "all, sequence_aware": {"checkpointing": "sequence_aware", "fused_loss": True, "tiled_mlp": True, "offload": True},
}


def sp_options(m: ModelShape, gpus: int, ring: int | None = None) -> list[tuple[int, int, int]]:
    """``(sp, ulysses, ring)`` for every sp dividing ``gpus`` (``ring`` applied where it divides sp)."""
    out = []
    for sp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        try:
            out.append((sp, *split_sp_size(sp, m.heads, ring if ring and sp % ring == 0 else None)))
        except ValueError:
            continue
    return out


def plan_table(m: ModelShape, base: Setting, budget_bytes: float, zeros: list[int]) -> list[dict]:
    """The longest length for every sp dividing ``base.gpus`` x ZeRO stage in ``zeros`` x ``STACKS`` combination
    (the rest of ``base`` kept: LoRA, dtype, device)."""
    rows, stacks = [], dict(STACKS)
    if base.device == "cpu":  # offloading is a no-op there
        stacks = {k: {f: v for f, v in fields.items() if f != "offload"} for k, fields in stacks.items()}
        stacks.pop("+ activation offload")
    if m.sparse is not None:  # sequence_aware and offload not counted with these layers (sparse.check_setting)
        stacks = {k: f for k, f in stacks.items() if not f.get("offload") and f["checkpointing"] != "sequence_aware"}
    for zero in zeros:
        for stack, fields in stacks.items():
            row = {"zero": zero, "lora": base.lora, "stack": stack, "longest": {}}
            for sp, ulysses, ring in sp_options(m, base.gpus, base.ring):
                stack_fields = {"tiled_mlp": False, "fused_loss": False, "offload": False} | fields
                setting = replace(base, sp=sp, ring=ring, zero=zero, **stack_fields)
                row["longest"][f"{sp} ({ulysses}x{ring})"] = longest_length(m, setting, budget_bytes)
            rows.append(row)
    return rows
