"""``checkpoint_policy="auto"``: keep the attention outputs of as many checkpointed layers as a memory budget allows.

``sequence_aware`` keeps, in every checkpointed layer, the attention kernels' outputs (their recomputation is the
``O(s^2)`` part); ``full`` keeps nothing. ``auto`` decides layer by layer, in every forward: a layer keeps its outputs
(``sequence_aware`` for that call) while what this forward has kept, plus the layer's share, fits the *allowance*

    allowance(tokens) = budget - resident - per_token x tokens - overshoot

``resident`` is the memory in use when the step began (weights, gradients, optimizer states), ``per_token`` what a
step that kept nothing needed above it, per local token (the first ``WARMUP_STEPS`` steps run as ``full`` and measure
it: the first one also allocates the optimizer states), both measured by the trainer (``integrations.memory_budget``:
CUDA's allocator, else the process's VmRSS / VmHWM). ``overshoot`` is the most a step that kept outputs needed beyond
them and beyond that prediction (on CPU the peak creeps up over the first steps): a low estimate is corrected from the
next step on. A layer's share is ``sequence_aware_kept_bytes`` (the planner's
figure).

A second level: where *every* layer keeps its attention outputs and budget is still left, layers also keep their
Ulysses all-to-all results (q, k, v received, the output sent back: ``exchange_kept_bytes`` more each), as many as
fit, so that their recomputation exchanges nothing. The all-to-alls come after the kernels because recomputing a
kernel costs ``O(s^2)`` work and an exchange ``O(s)`` bytes. The number of layers per forward is learnt in the warm-up
steps.

Below full checkpointing: where the allowance is negative (even keeping nothing would not fit) and offload hooks are
given (CUDA, without ``checkpoint_offloading``, which offloads every layer), the first layers of the forward move
their checkpointed inputs to host memory (``offload_bytes`` per token each), as many as it takes to fit. Exact: a kept
value is the one the recomputation would produce, an offloaded one comes back unchanged, so every choice trains
identically.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

TOKENS_DIM = 1  # a decoder layer's hidden states: [batch, local tokens, hidden]


def sequence_aware_kept_bytes(tokens: int, q_dim: int, element_bytes: int, ring: int = 1) -> float:
    """Bytes ``sequence_aware`` keeps in one attention layer for ``tokens`` local tokens: the kernel's output, in the
    SP layout (``q_dim`` = query heads x head dim per token), each ring block's (``~ (ring + 1) / 2`` per query)."""
    return q_dim * element_bytes * (ring + 1) / 2 * tokens


def exchange_kept_bytes(tokens: int, q_dim: int, kv_dim: int, element_bytes: int) -> float:
    """Bytes the second level keeps besides, in one attention layer for ``tokens`` local tokens: the Ulysses
    all-to-alls' results, q, k and v (``kv_dim``: k's and v's width per token after replication for the exchange) and
    the output (``q_dim``)."""
    return (2 * q_dim + 2 * kv_dim) * element_bytes * tokens


class KeepBudget:
    """Per model: which checkpointed layers of this forward keep their attention outputs (``checkpoint_policy=
    "auto"``), and which of them their all-to-all results too. ``layer_bytes``: a layer's kept bytes per local token
    (``sequence_aware_kept_bytes(1, ...)``); ``exchange_bytes``: the second level's, besides
    (``exchange_kept_bytes(1, ...)``; 0 or no ``exchange_context``: no second level, e.g. without Ulysses)."""

    WARMUP_STEPS = 2

    def __init__(
        self,
        budget: float,
        layer_bytes: float,
        keep_context: Callable,
        exchange_bytes: float = 0.0,
        exchange_context: Callable | None = None,
        offload_bytes: float = 0.0,
        offload: Any = None,
    ):
        if budget <= 0:
            raise ValueError(f"checkpoint_memory_budget={budget} bytes: the budget must be positive.")
        self.budget, self.layer_bytes, self.keep_context = float(budget), float(layer_bytes), keep_context
        self.exchange_bytes, self.exchange_context = float(exchange_bytes), exchange_context
        self.offload_bytes, self.offload = float(offload_bytes), offload  # offload: saved-tensor hooks (HostOffload)
        self.offloaded_layers: list[int] = []  # per training forward: how many layers offloaded their checkpoint
        self._offloads_planned = 0
        self.layers = 0  # checkpointed layer calls per forward (the most seen)
        self.kept_exchanges: list[int] = []  # per training forward: how many layers kept their all-to-all results
        self._calls = 0
        self._exchanges_planned = 0
        self.resident = 0.0  # memory in use at the start of the current step
        self.per_token: float | None = None  # peak above ``resident`` per local token, of a step that kept nothing
        self.overshoot = 0.0
        self.measured_steps = 0
        self.kept_layers: list[int] = []  # per training forward: how many layers kept their outputs
        self._used = 0.0
        self._step_kept: float | None = None  # the most a forward of this step kept, net of what it offloaded
        self._kept_before_forward: float | None = None
        self._step_tokens = 0
        self._open = False

    def start_forward(self) -> None:
        """A new forward (the model's forward pre-hook)."""
        self._used, self._open, self._calls = 0.0, False, 0

    def allowance(self, tokens: int) -> float:
        if self.per_token is None or self.measured_steps < self.WARMUP_STEPS:
            return 0.0
        return self.budget - self.resident - self.per_token * tokens - self.overshoot

    def exchanges_fitting(self, tokens: int) -> int:
        """How many layers of a forward keep their all-to-all results too: none unless every layer keeps its
        attention outputs, then as many as the rest of the allowance holds."""
        if self.exchange_context is None or self.exchange_bytes <= 0 or not self.layers:
            return 0
        left = self.allowance(tokens) - self.layers * self.layer_bytes * tokens
        if left < 0:
            return 0
        return min(self.layers, int(left // (self.exchange_bytes * tokens)))

    def offloads_needed(self, tokens: int) -> int:
        """How many layers of a forward offload their checkpointed inputs: where even keeping nothing would not fit,
        as many as it takes (all, if that is not enough either); none without hooks."""
        if self.offload is None or self.offload_bytes <= 0 or not self.layers:
            return 0
        short = -self.allowance(tokens)
        return 0 if short <= 0 else min(self.layers, math.ceil(short / (self.offload_bytes * tokens)))

    def context_for(self, hidden_states: torch.Tensor) -> Callable | None:
        """The checkpoint ``context_fn`` for one layer call (``decide``'s first half)."""
        return self.decide(hidden_states)[0]

    def decide(self, hidden_states: torch.Tensor) -> tuple[Callable | None, Any]:
        """For one layer call: the checkpoint ``context_fn`` (``exchange_context`` while the forward's planned second
        level lasts, else ``keep_context`` if the layer's outputs fit, else ``None``: recompute everything) and the
        offload hooks for its checkpoint (while the forward's planned offloads last, else ``None``)."""
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        if not self._open:  # the forward's first checkpointed layer
            self._open = True
            self.kept_layers.append(0)
            self.kept_exchanges.append(0)
            self.offloaded_layers.append(0)
            self._step_tokens = max(self._step_tokens, tokens)
            self._exchanges_planned = self.exchanges_fitting(tokens)
            self._offloads_planned = self.offloads_needed(tokens)
            self._kept_before_forward = self._step_kept
        self._calls += 1
        self.layers = max(self.layers, self._calls)
        offload = None
        if self.offloaded_layers[-1] < self._offloads_planned:
            self.offloaded_layers[-1] += 1
            self._used -= self.offload_bytes * tokens
            self._note_kept()
            offload = self.offload
        need = self.layer_bytes * tokens
        if self._used + need > self.allowance(tokens):
            return None, offload
        context = self.keep_context
        if self.kept_exchanges[-1] < self._exchanges_planned:
            need += self.exchange_bytes * tokens
            self.kept_exchanges[-1] += 1
            context = self.exchange_context
        self._used += need
        self._note_kept()
        self.kept_layers[-1] += 1
        return context, offload

    def _note_kept(self) -> None:
        """The step's net kept bytes: the most any of its forwards holds at its end (this one: so far)."""
        before = self._kept_before_forward
        self._step_kept = self._used if before is None else max(before, self._used)

    def start_step(self, resident_bytes: float | None) -> None:
        """The memory in use as an optimizer step begins (``None``: not measurable)."""
        if resident_bytes is not None:
            self.resident = float(resident_bytes)

    def end_step(self, peak_bytes: float | None) -> None:
        """The step's measured peak (``None``: not measurable): a step that kept and offloaded nothing sets
        ``per_token``; in one that did, what the peak held besides the kept outputs (plus the offloaded checkpoints)
        above the prediction raises ``overshoot`` (it never falls: the estimate only grows more careful)."""
        if peak_bytes is not None and self._step_tokens:
            self.measured_steps += 1
            if self._step_kept is None:
                self.per_token = max(0.0, peak_bytes - self.resident) / self._step_tokens
            elif self.per_token is not None:  # what the step needed besides its net kept bytes, above the prediction
                predicted = self.resident + self.per_token * self._step_tokens
                self.overshoot = max(self.overshoot, peak_bytes - self._step_kept - predicted)
        self._step_kept, self._step_tokens = None, 0


def budget_bytes(budget: float, device: torch.device) -> float:
    """``checkpoint_memory_budget`` in bytes: as given above 1, else a fraction of the CUDA device's memory."""
    if budget > 1:
        return float(budget)
    if budget <= 0:
        raise ValueError(f"checkpoint_memory_budget={budget}: give bytes (> 1) or a fraction of the device (0, 1].")
    if device.type != "cuda":
        raise ValueError(
            f"checkpoint_memory_budget={budget} is a fraction of the device's memory, which only CUDA devices have "
            f"here ({device}); give the budget in bytes."
        )
    return budget * torch.cuda.get_device_properties(device).total_memory


__all__ = ["KeepBudget", "budget_bytes", "exchange_kept_bytes", "sequence_aware_kept_bytes"]
