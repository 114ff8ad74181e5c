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
figure). Exact: a kept value is the one the recomputation would produce, so every choice trains identically.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TOKENS_DIM = 1  # a decoder layer's hidden states: [batch, local tokens, hidden]


def sequence_aware_kept_bytes(tokens: int, q_dim: int, element_bytes: int, ring: int = 1) -> float:
    """Bytes ``sequence_aware`` keeps in one attention layer for ``tokens`` local tokens: the kernel's output, in the
    SP layout (``q_dim`` = query heads x head dim per token), each ring block's (``~ (ring + 1) / 2`` per query)."""
    return q_dim * element_bytes * (ring + 1) / 2 * tokens


class KeepBudget:
    """Per model: which checkpointed layers of this forward keep their attention outputs (``checkpoint_policy=
    "auto"``). ``layer_bytes``: a layer's kept bytes per local token (``sequence_aware_kept_bytes(1, ...)``)."""

    WARMUP_STEPS = 2

    def __init__(self, budget: float, layer_bytes: float, keep_context: Callable):
        if budget <= 0:
            raise ValueError(f"checkpoint_memory_budget={budget} bytes: the budget must be positive.")
        self.budget, self.layer_bytes, self.keep_context = float(budget), float(layer_bytes), keep_context
        self.resident = 0.0  # memory in use at the start of the current step
        self.per_token: float | None = None  # peak above ``resident`` per local token, of a step that kept nothing
        self.overshoot = 0.0
        self.measured_steps = 0
        self.kept_layers: list[int] = []  # per training forward: how many layers kept their outputs
        self._used = 0.0
        self._step_kept = 0.0
        self._step_tokens = 0
        self._open = False

    def start_forward(self) -> None:
        """A new forward (the model's forward pre-hook)."""
        self._used, self._open = 0.0, False

    def allowance(self, tokens: int) -> float:
        if self.per_token is None or self.measured_steps < self.WARMUP_STEPS:
            return 0.0
        return self.budget - self.resident - self.per_token * tokens - self.overshoot

    def context_for(self, hidden_states: torch.Tensor) -> Callable | None:
        """The checkpoint ``context_fn`` for one layer call: ``keep_context`` if the layer's outputs fit, else
        ``None`` (recompute everything)."""
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        if not self._open:  # the forward's first checkpointed layer
            self._open = True
            self.kept_layers.append(0)
            self._step_tokens = max(self._step_tokens, tokens)
        need = self.layer_bytes * tokens
        if self._used + need > self.allowance(tokens):
            return None
        self._used += need
        self._step_kept = max(self._step_kept, self._used)
        self.kept_layers[-1] += 1
        return self.keep_context

    def start_step(self, resident_bytes: float | None) -> None:
        """The memory in use as an optimizer step begins (``None``: not measurable)."""
        if resident_bytes is not None:
            self.resident = float(resident_bytes)

    def end_step(self, peak_bytes: float | None) -> None:
        """The step's measured peak (``None``: not measurable): a step that kept nothing sets ``per_token``; in one
        that kept, what the peak held besides the kept outputs above the prediction raises ``overshoot`` (it never
        falls: the estimate only grows more careful)."""
        if peak_bytes is not None and self._step_tokens:
            self.measured_steps += 1
            if self._step_kept == 0:
                self.per_token = max(0.0, peak_bytes - self.resident) / self._step_tokens
            elif self.per_token is not None:  # what the step needed besides the kept outputs, above the prediction
                predicted = self.resident + self.per_token * self._step_tokens
                self.overshoot = max(self.overshoot, peak_bytes - self._step_kept - predicted)
        self._step_kept, self._step_tokens = 0.0, 0


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


__all__ = ["KeepBudget", "budget_bytes", "sequence_aware_kept_bytes"]
