"""The trainer's side of ``checkpoint_policy="auto"``: each optimizer step's peak memory handed to the model's
``KeepBudget`` (``memory.keep_budget``), and how many layers kept their attention outputs in the logs."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from ..memory.keep_budget import KeepBudget
from .throughput import _reset_vm_hwm, _status_mb, add_to_logs

KEPT_LAYERS_LOG = "checkpoint_kept_layers"


class KeepBudgetCallback(TrainerCallback):
    """Hands ``keep`` the memory in use at every step's start and the step's peak at its end (CUDA's allocator, else
    the process's VmRSS and VmHWM); logs the last training forward's kept layers as ``checkpoint_kept_layers``."""

    def __init__(self, keep: KeepBudget):
        self.keep = keep

    def _cuda(self, args) -> bool:
        return args.device.type == "cuda" and torch.cuda.is_available()

    def on_step_begin(self, args, state, control, **kwargs):
        if self._cuda(args):
            self.keep.start_step(float(torch.cuda.memory_allocated(args.device)))
            torch.cuda.reset_peak_memory_stats(args.device)
        else:
            self._resettable = _reset_vm_hwm()
            rss = _status_mb("VmRSS") if self._resettable else None
            self.keep.start_step(None if rss is None else rss * 2**20)

    def on_step_end(self, args, state, control, **kwargs):
        if self._cuda(args):
            peak = float(torch.cuda.max_memory_allocated(args.device))
        else:
            mb = _status_mb("VmHWM") if self._resettable else None  # a peak since the process start says nothing
            peak = None if mb is None else mb * 2**20
        self.keep.end_step(peak)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs and self.keep.kept_layers:
            add_to_logs(state, logs, {KEPT_LAYERS_LOG: self.keep.kept_layers[-1]})


__all__ = ["KEPT_LAYERS_LOG", "KeepBudgetCallback"]
