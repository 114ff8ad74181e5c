"""Throughput, step time, peak memory and MFU in the Trainer's logs: ``ThroughputCallback``.

Keys added to every training log entry (``state.log_history``, the progress bar / printer, and — when registered with
``add_throughput_callback`` — the ``report_to`` integrations), each measured on this process since the previous log:

- ``tokens_per_second_per_rank``: tokens this rank fed to its model in training forwards (training mode, gradients on:
  the no-grad forwards of generation and of reference / old-policy scoring in TRL's trainers are not counted), divided
  by the time spent in those optimizer steps. Under sequence parallelism a rank processes its shard, ``s / sp_size``
  tokens of every sequence (SP padding included), so the job's throughput is this times the world size. Counted from
  the shape of ``input_ids`` / ``inputs_embeds`` by a forward hook (``state.num_input_tokens_seen`` would not do: it
  counts the whole batch, summed over all ranks);
- ``step_time_s``: mean time of an optimizer step, ``on_step_begin`` -> ``on_step_end`` (all its micro-batches; data
  loading, evaluation and checkpointing are outside);
- ``peak_memory_mb``: peak memory in MiB; CUDA: ``max_memory_allocated``; CPU: ``VmHWM``, reset through
  ``/proc/self/clear_refs`` (where that is not permitted: the peak since the process started, with a warning);
- ``mfu`` (CUDA only): model FLOPs of the steps / their time / the device's peak FLOP/s (``training_flops``).

Cheap: the hook reads tensor shapes, and with MFU adds a few elementwise ops on ``position_ids`` whose result stays on
the device; the only synchronisation is one ``torch.cuda.synchronize`` (and one ``.item()``) at logging steps. No
collectives: every number is this rank's.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback
from transformers.utils import logging

from ..documents import DocumentHook, attached_documents
from ..model.decoder import unwrap_peft
from ..model.heads import attention_shapes

logger = logging.get_logger(__name__)

PEAK_FLOPS_ENV = "HF_SP_PEAK_FLOPS"
# Dense bf16/fp16 tensor-core peak FLOP/s, matched in order as substrings of torch.cuda.get_device_name().
# For fp32/tf32 training, or a device not listed, pass peak_flops= or set HF_SP_PEAK_FLOPS.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("B100", 1.75e15),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM, GH200
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("V100", 125e12),  # fp16
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    ("MI250X", 383e12),
)


def device_peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device: ``$HF_SP_PEAK_FLOPS`` if set, else the table's entry (None: unknown)."""
    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV])
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def causal_pairs(position_ids: torch.Tensor) -> torch.Tensor:
    """Visible (query, key) pairs of causal attention over packed rows, as a 0-dim int64 tensor on their device.

    A document starts where ``position_ids[t] != position_ids[t - 1] + 1`` (as ``DocumentLayout``); a document of
    ``n`` tokens has ``n (n + 1) / 2`` pairs, i.e. token ``i`` of a document sees ``i + 1`` keys. Computed without a
    device-to-host copy.
    """
    # [s] or [b, s]; [3, b, s] (multimodal rope): the first section
    pos = (position_ids[0] if position_ids.ndim == 3 else position_ids.reshape(-1, position_ids.shape[-1])).long()
    index = torch.arange(pos.shape[1], device=pos.device).expand_as(pos)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # start of each token's doc
    return (index - first + 1).sum()


def matmul_params(model: nn.Module) -> tuple[int, int]:
    """``(all, trainable)`` parameters used in matmuls: every parameter but the input embedding (a lookup), which is
    counted when tied to the LM head. ZeRO-3 / FSDP2 parameters count at their full size."""
    skip: set[int] = set()
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if embedding is not None and getattr(head, "weight", None) is not embedding.weight:
        skip = {id(p) for p in embedding.parameters()}
    total = trainable = 0
    for p in model.parameters():
        if id(p) in skip:
            continue
        n = int(getattr(p, "ds_numel", p.numel()))
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def attention_geometry(config: Any) -> tuple[int, int]:
    """``(layers, query heads x head_dim)`` of a decoder config, the width averaged over the layers where it differs
    (Gemma4's full-attention layers); ``(0, 0)`` when unknown: no attention term."""
    shapes = attention_shapes(config)
    if not shapes:
        return 0, 0
    return len(shapes), round(sum(s.heads * s.head_dim for s in shapes) / len(shapes))


def training_flops(tokens: float, pairs: float, params: int, trainable: int, layers: int, attn_width: int) -> float:
    """Model FLOPs of training (forward + backward) on ``tokens`` tokens with ``pairs`` causal (query, key) pairs.

    Weights: a multiply-add is 2 FLOPs per weight and token in forward, 2 more for the gradient of the activations and
    2 for the gradient of the weight, the last only for trainable weights: ``(4 params + 2 trainable) x tokens``
    (``6 params x tokens`` in full fine-tuning).
    Attention (not weights): per layer, query head and visible pair, ``QK^T`` and ``PV`` cost ``2 head_dim`` FLOPs
    each in forward, and backward runs four such products (``dP = dO V^T``, ``dV = P^T dO``, ``dQ = dS K``,
    ``dK = dS^T Q``): ``3 x 2 x 2 x pairs x heads x head_dim = 12 x pairs x attn_width`` per layer, with ``pairs =
    sum over documents of n (n + 1) / 2`` (about ``s^2 / 2`` for one causal document of ``s`` tokens).
    Model FLOPs, not hardware FLOPs: recomputation (gradient checkpointing), norms, softmax and elementwise ops are not
    counted, and sliding-window layers are counted as fully causal.
    """
    return (4 * params + 2 * trainable) * tokens + 12 * layers * attn_width * pairs


def _vm_hwm_mb() -> float | None:
    return _status_mb("VmHWM")


def _status_mb(key: str) -> float | None:
    """``key`` (``VmHWM``, ``VmRSS``) of this process in MiB; ``None`` where ``/proc`` doesn't say."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(f"{key}:"))
    except (OSError, StopIteration):
        return None


def _reset_vm_hwm() -> bool:
    """Reset VmHWM to the current resident size; False where that is not permitted (or not Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Counter:
    """Forward hook on the model: tokens (and with ``count_pairs`` attention pairs) of training forwards (training
    mode with gradients on)."""

    def __init__(self, count_pairs: bool, documents: DocumentHook | None = None):
        self.count_pairs, self.documents = count_pairs, documents
        self.reset()

    def reset(self) -> None:
        self.tokens, self.pairs_host = 0, 0.0
        self.pairs_device: torch.Tensor | None = None

    def pairs(self) -> float:
        """The pairs so far (a device-to-host copy: call at logging steps only)."""
        return self.pairs_host + (float(self.pairs_device.item()) if self.pairs_device is not None else 0.0)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = ids.shape if ids is not None else embeds.shape[:-1] if embeds is not None else None
        if shape is None or len(shape) == 0:
            return
        self.tokens += shape.numel()
        if not self.count_pairs:
            return
        layout = getattr(self.documents, "layout", None)
        position_ids = kwargs.get("position_ids")
        if layout is not None:  # SP: the whole sequence's documents, attention split evenly over the SP ranks
            pairs = sum((e - s) * (e - s + 1) / 2 for row in layout.segments for s, e in row)
            self.pairs_host += pairs / self.documents.topology.sp_size
        elif position_ids is not None:
            pairs = causal_pairs(position_ids)
            self.pairs_device = pairs if self.pairs_device is None else self.pairs_device + pairs
        else:  # unpacked rows: one causal document each
            self.pairs_host += shape.numel() // shape[-1] * shape[-1] * (shape[-1] + 1) / 2


class ThroughputCallback(TrainerCallback):
    """Adds ``tokens_per_second_per_rank``, ``step_time_s``, ``peak_memory_mb`` and on CUDA ``mfu`` to the training
    logs (see the module docstring). Works with any ``Trainer``: ``callbacks=[ThroughputCallback()]`` (then the
    ``report_to`` integrations, which run before user callbacks, miss the keys; ``add_throughput_callback(trainer)``
    puts it first).

    ``peak_flops``: the device's peak FLOP/s for MFU (default: ``$HF_SP_PEAK_FLOPS``, else ``PEAK_BF16_FLOPS`` by
    device name; unknown: no ``mfu``).
    """

    def __init__(self, peak_flops: float | None = None):
        self.peak_flops = peak_flops
        self._counter: _Counter | None = None
        self._handle = None
        self._warned_reset = False

    # -- what the device offers ------------------------------------------------------------------------------------
    def resolve_peak_flops(self, device: torch.device) -> float | None:
        """Peak FLOP/s used for MFU on ``device``: None (no MFU) off CUDA or for an unknown GPU."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        if self.peak_flops is not None:
            return self.peak_flops
        name = torch.cuda.get_device_name(device)
        peak = device_peak_flops(name)
        if peak is None:
            logger.warning_once(f"ThroughputCallback: peak FLOP/s of {name!r} unknown; set {PEAK_FLOPS_ENV} for mfu.")
        return peak

    def _reset_peak_memory(self) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        elif not _reset_vm_hwm() and not self._warned_reset:
            self._warned_reset = True
            logger.warning("ThroughputCallback: can't reset VmHWM; peak_memory_mb is the peak since the process start.")

    def _peak_memory_mb(self) -> float | None:
        return torch.cuda.max_memory_allocated(self._device) / 2**20 if self._cuda else _vm_hwm_mb()

    # -- callback events -------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs):
        self._device = args.device
        self._cuda = self._device.type == "cuda" and torch.cuda.is_available()
        self._peak = self.resolve_peak_flops(self._device)
        if self._handle is not None:
            self._handle.remove()
        self._counter = self._handle = None
        if model is not None:
            from ..attention.ulysses import is_sp_key

            # the transformers model under a PEFT wrapper: it sees this rank's shard (preference trainers shard in
            # a pre-hook on it)
            model = unwrap_peft(model)

            documents = None  # under SP, the whole sequence's documents of this model's forward
            if is_sp_key(getattr(model.config, "_attn_implementation", None)):
                documents = attached_documents(model)
            self._counter = _Counter(count_pairs=self._peak is not None, documents=documents)
            self._handle = model.register_forward_hook(self._counter, with_kwargs=True)
            if self._peak is not None:
                self._flops_args = (*matmul_params(model), *attention_geometry(model.config))
        self._busy, self._steps, self._start = 0.0, 0, None
        self._reset_peak_memory()

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._start is None:
            return
        if control.should_log and self._cuda:
            torch.cuda.synchronize(self._device)  # the logged steps' work is done: their time is complete
        self._busy += time.perf_counter() - self._start
        self._steps, self._start = self._steps + 1, None

    def on_log(self, args, state, control, logs: dict | None = None, **kwargs):
        if logs is None or "loss" not in logs or self._steps == 0 or self._counter is None:
            return
        add_to_logs(state, logs, self.metrics())

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def metrics(self) -> dict[str, float]:
        """This window's numbers (since the previous call); starts the next window."""
        busy = max(self._busy, 1e-9)
        out = {
            "tokens_per_second_per_rank": _round(self._counter.tokens / busy),
            "step_time_s": _round(busy / self._steps),
        }
        peak = self._peak_memory_mb()
        if peak is not None:
            out["peak_memory_mb"] = _round(peak)
        if self._peak is not None:
            flops = training_flops(self._counter.tokens, self._counter.pairs(), *self._flops_args)
            out["mfu"] = _round(flops / busy / self._peak)
        self._counter.reset()
        self._busy, self._steps = 0.0, 0
        self._reset_peak_memory()
        return out


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def add_throughput_callback(trainer: Any, callback: ThroughputCallback | None = None) -> ThroughputCallback:
    """Register ``callback`` (default: a new one) on ``trainer`` right after ``DefaultFlowCallback``, so that every
    other callback, the ``report_to`` integrations included, sees its keys; an already registered one is kept."""
    callbacks = trainer.callback_handler.callbacks
    existing = next((cb for cb in callbacks if isinstance(cb, ThroughputCallback)), None)
    if existing is not None:
        return existing
    return insert_after_default_flow(trainer, callback or ThroughputCallback())


def insert_after_default_flow(trainer: Any, callback: Any) -> Any:
    """Register ``callback`` right after ``DefaultFlowCallback``: every other callback, the ``report_to`` integrations
    included, sees the keys it adds to the logs."""
    callbacks = trainer.callback_handler.callbacks
    index = next((i + 1 for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)), 0)
    callbacks.insert(index, callback)
    return callback


def add_to_logs(state: Any, logs: dict, metrics: dict) -> None:
    """``metrics`` into a training log line: the ``logs`` the later callbacks see, and the copy the Trainer appended
    to ``state.log_history`` before calling ``on_log``."""
    logs.update(metrics)
    last = state.log_history[-1] if state.log_history else None
    if last is not None and "loss" in last and last.get("step") == state.global_step:
        last.update(metrics)


__all__ = [
    "PEAK_BF16_FLOPS",
    "add_to_logs",
    "insert_after_default_flow",
    "ThroughputCallback",
    "add_throughput_callback",
    "attention_geometry",
    "causal_pairs",
    "device_peak_flops",
    "matmul_params",
    "training_flops",
]
