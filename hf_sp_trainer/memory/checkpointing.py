"""Sequence-aware selective checkpointing and checkpoint offload, wrapped around transformers' checkpoint function.

With ``activation_checkpointing`` every decoder layer runs through ``layer._gradient_checkpointing_func`` (non-reentrant
``torch.utils.checkpoint.checkpoint``). ``enable_checkpoint_features`` wraps that function:

- ``checkpoint_policy="sequence_aware"`` passes a selective-checkpoint ``context_fn`` whose policy saves the outputs
  of the ops whose recomputation costs ``O(s^2)`` work: the attention kernels (SDPA backends, flash-attn, flex
  attention, SP's block kernels; ``bmm`` / ``softmax`` of eager attention), in their SP layout (the sequence whole,
  the heads split), which shrinks with sp. Every other op is recomputed: projections, MLP, norms, RoPE (``O(s)``),
  everything inside a hybrid mixer (``recompute_region``: its chunk matmuls are ``O(s)``), and the Ulysses
  all-to-alls. Keeping their results too (q, k, v and the output, full-sequence for a slice of heads) would make the
  memory saved per rank *grow* with sp for the same length; re-running them costs one more exchange per layer in the
  backward. Exact: saved values are the ones the recomputation would produce.
- ``checkpoint_policy="auto"`` (with ``checkpoint_memory_budget``) keeps, forward by forward, what ``sequence_aware``
  keeps in as many layers as the budget allows and recomputes the others; where every layer keeps that and budget
  is left, layers also keep their all-to-all results (``exchange_keeping_policy``), so that their recomputation
  exchanges nothing (``keep_budget.KeepBudget``).
- ``checkpoint_offloading`` moves what the checkpoint itself saves, the layer's input hidden states, to host memory
  (``offload.HostOffload``); on CPU there is no device memory to free and it is a no-op (with a warning).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import logging

from .. import patches
from ..attention.ring import ring_attention_op
from ..attention.ulysses import kv_replication
from ..comm.all_to_all import all_to_all_op, all_to_all_packed_op
from ..documents import current_scope, run_in_scope
from ..model.decoder import decoder_layers, unwrap_peft
from ..model.heads import attention_shapes
from .keep_budget import KeepBudget, budget_bytes, exchange_kept_bytes, sequence_aware_kept_bytes
from .offload import HostOffload

logger = logging.get_logger(__name__)

POLICIES = ("full", "sequence_aware", "auto")
KEEP_BUDGET_MARK = "_sp_keep_budget"  # the model's KeepBudget under checkpoint_policy="auto"
_ATEN_SAVED = (
    # fused attention kernels (CUDA, CPU, cuDNN, other backends)
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    # eager attention (and the SDPA math fallback): the only batched matmuls and softmax of a dense decoder layer
    "bmm",
    "baddbmm",
    "_softmax",
)


@functools.cache
def saved_ops() -> frozenset:
    """The ops whose outputs ``sequence_aware`` saves (matched by identity; flash-attn kernels by name). Not the
    all-to-alls (``comm.all_to_all``): recomputed, so the saved bytes per rank shrink with sp."""
    ops = {getattr(torch.ops.aten, name).default for name in _ATEN_SAVED if hasattr(torch.ops.aten, name)}
    ops.add(ring_attention_op._opoverload)  # the block kernels of Ulysses (CPU sdpa/eager, varlen) and of the ring
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return frozenset(ops)


@functools.cache
def _is_saved(op) -> bool:
    return op in saved_ops() or "flash_attn" in str(op)


_RECOMPUTE_DEPTH = [0]  # how many recompute_region()s are open


@contextlib.contextmanager
def recompute_region():
    """Ops run inside are recomputed under ``sequence_aware``, whatever they are: the SP hybrid mixers (``mixers/``)
    run their chunked recurrences through ``bmm`` / ``softmax``, ``O(s)`` work that would otherwise be saved as if
    it were attention. Entered in the forward and in its recomputation alike, so both make the same decisions."""
    _RECOMPUTE_DEPTH[0] += 1
    try:
        yield
    finally:
        _RECOMPUTE_DEPTH[0] -= 1


def sequence_aware_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # called for every op of every recomputed layer: the decision is cached per op
    if _RECOMPUTE_DEPTH[0]:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if _is_saved(op) else CheckpointPolicy.PREFER_RECOMPUTE


def sequence_aware_context_fn():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (one fresh cache per checkpointed call)."""
    return create_selective_checkpoint_contexts(sequence_aware_policy)


@functools.cache
def exchange_ops() -> frozenset:
    """The Ulysses all-to-alls (q, k and v in one exchange; the output back), as dispatcher ops."""
    return frozenset({all_to_all_op._opoverload, all_to_all_packed_op._opoverload})


def exchange_keeping_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """``sequence_aware_policy`` that also saves the all-to-alls' results (``auto``'s second level): the layer's
    recomputation then exchanges nothing. Not inside ``recompute_region`` (the hybrid mixers recompute everything)."""
    if not _RECOMPUTE_DEPTH[0] and op in exchange_ops():
        return CheckpointPolicy.MUST_SAVE
    return sequence_aware_policy(ctx, op, *args, **kwargs)


def exchange_keeping_context_fn():
    """``context_fn`` of a layer keeping its attention outputs and its all-to-all results."""
    return create_selective_checkpoint_contexts(exchange_keeping_policy)


class MemoryCheckpoint:
    """A layer's checkpoint function with the selective policy and/or the offload hooks around it; the layer runs,
    in its forward and in its recompute alike, under the SP scope of its forward (``documents.run_in_scope``: the
    recompute happens in the backward, outside any decoder forward)."""

    def __init__(self, inner, context_fn=None, offload: HostOffload | None = None):
        self.inner, self.context_fn, self.offload = inner, context_fn, offload

    def __call__(self, function, *args, **kwargs):
        function = functools.partial(run_in_scope, current_scope(), function)
        context_fn, offload = self.context_fn, self.offload
        if isinstance(context_fn, KeepBudget):  # auto: this call keeps, recomputes or offloads, as the budget allows
            context_fn, chosen = context_fn.decide(_hidden_states(args, kwargs))
            offload = offload or chosen
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        if offload is None:
            return self.inner(function, *args, **kwargs)
        if context_fn is not None and _takes_respect_hooks(self.inner):
            # torch >= 2.14: what the selective policy keeps stays on the device, outside the offload hooks (as
            # before 2.14, and as the memory budget counts it), said explicitly: torch warns otherwise, and announced
            # routing it through the hooks by default
            kwargs["respect_saved_tensors_hooks"] = False
        with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
            return self.inner(function, *args, **kwargs)


@functools.lru_cache(maxsize=64)  # called for every checkpointed layer call; a layer's function is the same each time
def _takes_respect_hooks(checkpoint_function) -> bool:
    """The checkpoint function (torch's, possibly a ``functools.partial`` of it) has torch 2.14's
    ``respect_saved_tensors_hooks``."""
    import inspect

    try:
        return "respect_saved_tensors_hooks" in inspect.signature(checkpoint_function).parameters
    except (TypeError, ValueError):
        return False


def _hidden_states(args: tuple, kwargs: dict) -> torch.Tensor:
    """The layer's hidden states ``[batch, tokens, hidden]``: its first tensor argument."""
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value) and value.ndim == 3:
            return value
    raise ValueError("checkpoint_policy='auto' found no [batch, tokens, hidden] tensor among a layer's arguments.")


class MemoryCheckpointedLayer:
    """Mixed in front of a decoder-layer class: whatever checkpoint function transformers assigns to the layer (when
    checkpointing is switched on, in ``Trainer.train`` or by PEFT / TRL) is used through ``MemoryCheckpoint``."""

    @property
    def _gradient_checkpointing_func(self):
        inner = self.__dict__.get("_sp_checkpoint_inner")
        if inner is None:
            raise AttributeError("_gradient_checkpointing_func")
        context_fn, offload = self.__dict__["_sp_checkpoint_settings"]
        return MemoryCheckpoint(inner, context_fn, offload)

    @_gradient_checkpointing_func.setter
    def _gradient_checkpointing_func(self, function) -> None:
        self.__dict__["_sp_checkpoint_inner"] = function


_LAYER_CLASSES: dict[type, type] = {}


def _memory_class(cls: type) -> type:
    if issubclass(cls, MemoryCheckpointedLayer):
        return cls
    if cls not in _LAYER_CLASSES:
        swapped = type(cls.__name__, (MemoryCheckpointedLayer, cls), {"__module__": __name__})
        globals()[f"_{cls.__name__}"] = swapped  # so that pickling a model finds the class by name
        swapped.__qualname__ = f"_{cls.__name__}"
        _LAYER_CLASSES[cls] = swapped
    return _LAYER_CLASSES[cls]


def check_checkpoint_function(cls: type) -> None:
    """transformers' ``GradientCheckpointingLayer`` runs a checkpointed layer's forward through the instance's
    ``_gradient_checkpointing_func(function, *args)`` (a probe layer in training mode), which the swapped class
    wraps; and ``cls`` is such a layer."""
    if not issubclass(cls, GradientCheckpointingLayer):
        raise TypeError(f"{cls.__qualname__} is not a transformers GradientCheckpointingLayer")
    _check_checkpoint_hook()


@functools.cache
def _check_checkpoint_hook() -> None:
    class Probe(GradientCheckpointingLayer):
        def forward(self, x, scale=1.0):
            return x * scale

    calls = []

    def recorded(function, *args):
        calls.append(args)
        return function(*args)

    probe = Probe()
    probe.gradient_checkpointing, probe._gradient_checkpointing_func = True, recorded
    x = torch.ones(2, requires_grad=True)
    with torch.enable_grad():
        out = probe(x, scale=3.0)
    if len(calls) != 1 or calls[0][0] is not x or not torch.equal(out, x.detach() * 3):
        raise ValueError(
            "GradientCheckpointingLayer no longer runs a checkpointed layer through _gradient_checkpointing_func"
        )


def _unwrap_checkpoint_function(layer: torch.nn.Module) -> None:
    """After an undo: transformers' own checkpoint function back where it keeps it, our settings gone."""
    inner = layer.__dict__.pop("_sp_checkpoint_inner", None)
    layer.__dict__.pop("_sp_checkpoint_settings", None)
    if inner is not None:
        layer.__dict__["_gradient_checkpointing_func"] = inner


def wrap_checkpointed_layers(model: torch.nn.Module, context_fn=None, offload: HostOffload | None = None) -> int:
    """Give every decoder layer of ``model`` these checkpoint settings (once, through the patch registry: the
    layer's class swapped for one whose checkpoint function is wrapped); returns the number of layers."""
    return _wrap_layers(model, (context_fn, offload), replace=True)


def scope_checkpointed_layers(model: torch.nn.Module) -> int:
    """Make every decoder layer of ``model`` recompute under the SP scope of its forward (the same class swap, with
    no memory settings unless ``wrap_checkpointed_layers`` gives some), for every model with a swapped kernel: the
    kernels of a layer that drops SP's kwargs (``MambaModel``'s, Mamba1's selective scan, the selection indexers)
    find them in the scope, also when checkpointing replays the layer (else they would raise there)."""
    return _wrap_layers(model, (None, None), replace=False)


def _wrap_layers(model: torch.nn.Module, settings: tuple, replace: bool) -> int:
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    for name, layer in layers:
        if not isinstance(layer, MemoryCheckpointedLayer):
            patches.patch(
                layer,
                "__class__",
                replacement=_memory_class(type(layer)),
                check=check_checkpoint_function,
                reason="the layer's checkpoint function wrapped: recompute under the forward's SP scope, and "
                "checkpoint_policy / activation checkpoint offloading",
                where=name or type(model).__name__,
                on_undo=_unwrap_checkpoint_function,
            )
        # set by transformers before the swap: shadowed by the class's property now, handed to it
        current = layer.__dict__.pop("_gradient_checkpointing_func", None)
        if replace or "_sp_checkpoint_settings" not in layer.__dict__:
            layer.__dict__["_sp_checkpoint_settings"] = settings
        if current is not None and "_sp_checkpoint_inner" not in layer.__dict__:
            layer._gradient_checkpointing_func = current
    return len(layers)


def _checkpointing_on(args) -> bool:
    """``activation_checkpointing`` (transformers >= 5.24), or its deprecated alias ``gradient_checkpointing``."""
    return bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False))


def _checkpoint_kwargs(args) -> dict[str, Any]:
    kwargs = getattr(args, "activation_checkpointing_kwargs", None)
    return dict(kwargs or getattr(args, "gradient_checkpointing_kwargs", None) or {})


def checkpointed_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers transformers runs through ``_gradient_checkpointing_func``."""
    return [m for m in decoder_layers(model) if m.gradient_checkpointing]


def enable_checkpoint_features(model: torch.nn.Module, args, ring_size: int = 1, ulysses_size: int = 1) -> None:
    """Wrap the checkpoint function of ``model``'s checkpointed layers as ``args`` ask (``checkpoint_policy``,
    ``checkpoint_offloading``).

    Transformers switches checkpointing on later (in ``Trainer.train``; PEFT / TRL may switch it on again), so the
    decoder layers are given, once, a class whose checkpoint function is always wrapped (``MemoryCheckpointedLayer``).
    ``ring_size`` / ``ulysses_size``: the SP topology's (``auto`` estimates the bytes a layer keeps). Raises a
    ``ValueError`` for an unknown policy, ``auto`` without a budget, and either feature without (non-reentrant, for
    the policy) activation checkpointing.
    """
    policy, offload = getattr(args, "checkpoint_policy", "full"), getattr(args, "checkpoint_offloading", False)
    if policy not in POLICIES:
        raise ValueError(f"checkpoint_policy={policy!r} is not one of {POLICIES}.")
    selective = policy != "full"
    if not (selective or offload):
        return
    wanted = " and ".join(
        n for n, on in ((f"checkpoint_policy={policy!r}", selective), ("checkpoint_offloading", offload)) if on
    )
    if not (_checkpointing_on(args) or checkpointed_modules(model)):
        raise ValueError(
            f"{wanted} act on activation checkpointing, which is off: set activation_checkpointing=True "
            "(gradient_checkpointing=True before transformers 5.24)."
        )
    if selective and _checkpoint_kwargs(args).get("use_reentrant"):
        raise ValueError(
            f"checkpoint_policy={policy!r} needs non-reentrant checkpointing (the transformers default); remove "
            "use_reentrant=True from activation_checkpointing_kwargs."
        )
    if selective and _checkpoint_kwargs(args).get("selective"):
        raise ValueError(
            f"checkpoint_policy={policy!r} and TRL's gradient_checkpointing_kwargs={{'selective': True}} are two "
            "selective-checkpoint policies; use one of them."
        )
    hooks = None
    if offload:
        if torch.cuda.is_available():
            hooks = HostOffload()
        else:
            logger.warning_once(
                "checkpoint_offloading=True has no effect on CPU: the checkpointed activations already live in host "
                "memory. Training proceeds without offloading."
            )
    context_fn = sequence_aware_context_fn if selective else None
    if policy == "auto":  # it may offload where even full checkpointing won't fit (CUDA, unless every layer does)
        chosen = HostOffload() if torch.cuda.is_available() and not offload else None
        context_fn = keep_budget(model, args, ring_size, ulysses_size, offload=chosen)
    if context_fn is not None or hooks is not None:
        wrap_checkpointed_layers(model, context_fn, hooks)


def keep_budget(
    model: torch.nn.Module, args, ring_size: int = 1, ulysses_size: int = 1, offload: HostOffload | None = None
) -> KeepBudget:
    """The ``KeepBudget`` of ``model`` for ``args.checkpoint_memory_budget`` (held by the model, reset by a forward
    pre-hook at every forward); its steps' peaks come from the trainer (``integrations.memory_budget``).
    ``offload``: the hooks it may offload a layer's checkpoint with (``None``: it never offloads)."""
    budget = getattr(args, "checkpoint_memory_budget", None)
    if budget is None:
        raise ValueError(
            "checkpoint_policy='auto' needs checkpoint_memory_budget: the memory one rank may use, in bytes, or as "
            "a fraction of the CUDA device's memory (e.g. 0.9)."
        )
    shapes = attention_shapes(unwrap_peft(model).config.get_text_config())  # the widest layer's (none: no attention)
    width = max((s.heads * s.head_dim for s in shapes), default=0)
    kv_width = max((s.kv_heads * kv_replication(s.kv_heads, ulysses_size) * s.head_dim for s in shapes), default=0)
    element = 2 if getattr(args, "bf16", False) or getattr(args, "fp16", False) else model.dtype.itemsize
    layer_bytes = sequence_aware_kept_bytes(1, width, element, ring_size)
    exchanges = ulysses_size > 1  # else no all-to-all to keep
    keep = KeepBudget(
        budget_bytes(budget, args.device),
        layer_bytes,
        sequence_aware_context_fn,
        exchange_bytes=exchange_kept_bytes(1, width, kv_width, element) if exchanges else 0.0,
        exchange_context=exchange_keeping_context_fn if exchanges else None,
        offload_bytes=unwrap_peft(model).config.get_text_config().hidden_size * element,  # a layer's input
        offload=offload,
    )
    existing = getattr(model, KEEP_BUDGET_MARK, None)
    if existing is not None:
        existing._hook.remove()
    keep._hook = model.register_forward_pre_hook(lambda *_: keep.start_forward())
    setattr(model, KEEP_BUDGET_MARK, keep)
    return keep
