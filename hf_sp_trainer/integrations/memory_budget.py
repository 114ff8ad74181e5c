"""The trainer's side of ``checkpoint_policy="auto"``: each optimizer step's memory handed to the model's
``KeepBudget`` (``memory.keep_budget``), and how many layers kept their attention outputs (and their all-to-all
results) in the logs.

Every rank is handed the largest figure over all ranks, so the ranks of an SP group (equal shards) keep the same
layers: a layer that keeps its attention output skips the kernel in its recompute, and with a ring that kernel passes
K/V between the ranks (ranks deciding differently would wait on each other forever).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ..memory.keep_budget import KeepBudget
from .throughput import _reset_vm_hwm, _status_mb, add_to_logs

KEPT_LAYERS_LOG = "checkpoint_kept_layers"
KEPT_EXCHANGES_LOG = "checkpoint_kept_exchanges"
OFFLOADED_LAYERS_LOG = "checkpoint_offloaded_layers"


def largest_over_ranks(value: float | None, device: torch.device) -> float | None:
    """``value``'s maximum over every rank (``None``: not measured there; ``None`` only if nowhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([-1.0 if value is None else float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return None if t.item() < 0 else t.item()


class KeepBudgetCallback(TrainerCallback):
    """Hands ``keep`` the memory in use at every step's start and the step's peak at its end (CUDA's allocator, else
    the process's VmRSS and VmHWM; each the largest over all ranks); logs the last training forward's kept layers as
    ``checkpoint_kept_layers``, those of them that kept their all-to-all results too as
    ``checkpoint_kept_exchanges``, and the layers that offloaded their checkpoint as ``checkpoint_offloaded_layers``
    (only with offload hooks: CUDA)."""

    def __init__(self, keep: KeepBudget):
        self.keep = keep

    @staticmethod
    def _cuda(args) -> bool:
        return args.device.type == "cuda" and torch.cuda.is_available()

    def _device(self, args) -> torch.device:
        return args.device if self._cuda(args) else torch.device("cpu")  # gloo's tensors live on the CPU

    def on_step_begin(self, args, state, control, **kwargs):
        if self._cuda(args):
            resident = float(torch.cuda.memory_allocated(args.device))
            torch.cuda.reset_peak_memory_stats(args.device)
        else:
            self._resettable = _reset_vm_hwm()
            rss = _status_mb("VmRSS") if self._resettable else None
            resident = None if rss is None else rss * 2**20
        self.keep.start_step(largest_over_ranks(resident, self._device(args)))

    def on_step_end(self, args, state, control, **kwargs):
        if self._cuda(args):
            peak = float(torch.cuda.max_memory_allocated(args.device))
        else:
            mb = _status_mb("VmHWM") if self._resettable else None  # a peak since the process start says nothing
            peak = None if mb is None else mb * 2**20
        self.keep.end_step(largest_over_ranks(peak, self._device(args)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs and self.keep.kept_layers:
            kept = {KEPT_LAYERS_LOG: self.keep.kept_layers[-1], KEPT_EXCHANGES_LOG: self.keep.kept_exchanges[-1]}
            if self.keep.offload is not None:
                kept[OFFLOADED_LAYERS_LOG] = self.keep.offloaded_layers[-1]
            add_to_logs(state, logs, kept)


__all__ = ["KEPT_EXCHANGES_LOG", "KEPT_LAYERS_LOG", "OFFLOADED_LAYERS_LOG", "KeepBudgetCallback", "largest_over_ranks"]
