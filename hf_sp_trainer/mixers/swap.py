"""Plugging the SP mixers into transformers' hybrid layers, in one place.

transformers' hybrid layers call module-level kernel functions of their modeling module (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ...) with the decoder's ``**kwargs``, which under SP carry the whole sequence's
document bounds. ``attach_mixers`` swaps each such function of the model's modeling modules, through the patch
registry (``hf_sp_trainer.patches``), for an entry that runs the exact SP version when those bounds are present (an
SP forward) and transformers' function otherwise. A function is swapped only after a check on a small input that the
installed one still computes what the SP version relies on (``check_kernel``: transformers' torch path, and the kernel
its hub wrapper dispatches to where that can run here); a test fails loudly when a release moves or changes one.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import patches
from ..documents import BOUNDS_KWARG, SP_KWARG, DocumentHook
from ..memory.checkpointing import recompute_region
from ..model.mixers import DECODE_ONLY_KERNELS, SP_KERNELS, SP_MODULES, covered_mixers
from ..sharding import SequenceSharding
from ..topology import SPTopology
from .causal_conv import sp_causal_conv1d
from .gated_deltanet import sp_chunk_gated_delta_rule
from .lightning import lightning_forward
from .mamba2 import run_decay, sp_mamba2_chunk_scan, step_sizes
from .runs import shard_runs

STATE_PASSING = ("gather", "relay")  # linear_state.py (the default) and relay.py (a debugging aid)
# Kernels whose SP version calls the installed function itself (``core`` / ``scan`` below): with flash-linear-attention
# or mamba-ssm installed, the hub wrapper's dispatch target (the conv's SP version is our own torch conv).
DISPATCHED = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "mamba2_chunk_scan")


def check_state_passing(state_passing: str) -> None:
    """``sp_state_passing`` must name one of ``STATE_PASSING``."""
    if state_passing not in STATE_PASSING:
        raise ValueError(
            f"sp_state_passing={state_passing!r} is not one of {list(STATE_PASSING)}: 'gather' (the default) or "
            "'relay' (a sequential debugging aid)."
        )


@dataclass
class MixerContext:
    """Where this process's tokens sit: its SP topology, or ``None`` at sp_size 1 (the whole sequence, no group),
    and how recurrent state crosses the ranks (``STATE_PASSING``)."""

    topology: SPTopology | None
    sharding: SequenceSharding
    state_passing: str = "gather"

    @property
    def relay(self) -> bool:
        return self.state_passing == "relay"

    @property
    def group(self):
        return None if self.topology is None else self.topology.sp_group

    def runs(self, bounds: torch.Tensor, rows: int):
        return shard_runs(bounds, rows, self.sharding, 0 if self.topology is None else self.topology.sp_rank)


def _sp_call(kwargs: dict) -> tuple[torch.Tensor | None, MixerContext | None]:
    """The documents and the mixer context of the model being run, which its decoder pre-hook passes down (popped
    from ``kwargs``); ``(None, None)`` outside an SP forward (no pre-hook, or cached decoding)."""
    bounds, context = kwargs.pop(BOUNDS_KWARG, None), kwargs.pop(SP_KWARG, None)
    mixers = (context or {}).get("mixers")
    return (bounds, mixers) if bounds is not None and mixers is not None else (None, None)


def _conv_entry(original: Callable) -> Callable:
    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        bounds, ctx = _sp_call(kwargs)
        if ctx is None:
            return original(hidden_states, weight, bias=bias, activation=activation, **kwargs)
        runs = ctx.runs(bounds, hidden_states.shape[0])
        with recompute_region():
            return sp_causal_conv1d(hidden_states, weight, bias, activation, runs, ctx.group)

    return causal_conv1d_fn


def _gdn_entry(original: Callable) -> Callable:
    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, **kwargs):
        bounds, ctx = _sp_call(kwargs)
        if ctx is None:
            # by keyword: with flash-linear-attention installed, ``original`` is FLA's kernel, whose 6th parameter is
            # ``scale`` (transformers' hub wrapper drops the ``chunk_size`` FLA doesn't take)
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, **kwargs)
        runs = ctx.runs(bounds, query.shape[0])
        options = {
            k: kwargs[k] for k in ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel") if k in kwargs
        }
        core = functools.partial(original, chunk_size=chunk_size)
        with recompute_region():
            return sp_chunk_gated_delta_rule(
                core, query, key, value, g, beta, runs, ctx.group, relay=ctx.relay, **options
            )

    return torch_chunk_gated_delta_rule


def _mamba2_entry(original: Callable) -> Callable:
    @functools.wraps(original)
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, **kwargs):
        bounds, ctx = _sp_call(kwargs)
        if ctx is None:
            return original(hidden_states, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, **kwargs)
        if kwargs.get("initial_states") is not None or kwargs.get("return_final_states", False):
            raise ValueError("Mamba2 under sequence parallelism runs without a cache (use_cache=False).")
        runs = ctx.runs(bounds, hidden_states.shape[0])
        options = {k: kwargs[k] for k in ("dt_softplus", "dt_limit") if k in kwargs}
        scan = functools.partial(original, chunk_size=chunk_size)
        with recompute_region():
            return sp_mamba2_chunk_scan(
                scan, hidden_states, dt, A, B, C, runs, ctx.group, D=D, dt_bias=dt_bias, relay=ctx.relay, **options
            )

    return mamba2_chunk_scan


def _unfused_entry(original: Callable) -> Callable:
    """The fused whole-layer Mamba2 path (``mamba_ssm``'s ``mamba_split_conv1d_scan_combined``) returns ``None``
    under SP, as its torch fallback always does: the layer then runs its unfused path through the swapped kernels."""

    @functools.wraps(original)
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        if kwargs.get(BOUNDS_KWARG) is not None:
            return None
        return original(*args, **kwargs)

    return mamba2_split_conv1d_scan_combined


def _decode_only_entry(original: Callable) -> Callable:
    @functools.wraps(original)
    def decode_kernel(*args, **kwargs):
        if kwargs.get(BOUNDS_KWARG) is not None:
            raise ValueError(f"{original.__name__} (cached decoding) can't run under sequence parallelism.")
        return original(*args, **kwargs)

    return decode_kernel


def _lightning_entry(original: Callable) -> Callable:
    """MiniMax's lightning attention: its forward with the recurrence run by ``lightning_forward`` under SP."""
    padding = sys.modules[original.__module__].apply_mask_to_padding_states

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        bounds, ctx = _sp_call(kwargs)
        if ctx is None:
            return original(self, hidden_states, *args, **kwargs)
        if args or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("Lightning attention under sequence parallelism runs without a cache (use_cache=False).")
        runs = ctx.runs(bounds, hidden_states.shape[0])
        mask = kwargs.get("attention_mask")
        with recompute_region():
            return lightning_forward(self, hidden_states, mask, runs, ctx.group, padding, relay=ctx.relay)

    return forward


def _kernel_check(module_name: str, name: str, device, fn: Callable) -> None:
    """``check_kernel``: the installed kernel still computes what its SP version relies on (a small input, on the
    CPU and where the kernel its hub wrapper dispatches to runs)."""
    check_kernel(module_name, name, fn, device)


def _kernel_check(module_name: str, name: str, device, fn: Callable) -> None:
    """``check_kernel``: the installed kernel still computes what its SP version relies on (a small input, on the
    CPU and where the kernel its hub wrapper dispatches to runs)."""
    check_kernel(module_name, name, fn, device)


ENTRIES: dict[str, Callable[[Callable], Callable]] = {
    "causal_conv1d_fn": _conv_entry,
    "torch_chunk_gated_delta_rule": _gdn_entry,
    "chunk_kimi_delta_attention": _gdn_entry,  # KDA: the delta rule with a per-channel decay, the same SP algorithm
    "mamba2_chunk_scan": _mamba2_entry,
    "mamba2_split_conv1d_scan_combined": _unfused_entry,
}
assert set(ENTRIES) == set(SP_KERNELS), "detect.SP_KERNELS must name exactly the swapped kernels"
# Mixer classes whose forward is swapped (no kernel function to hook): class name -> entry
MODULE_ENTRIES: dict[str, Callable[[Callable], Callable]] = {"MiniMaxLightningAttention": _lightning_entry}
assert set(MODULE_ENTRIES) == set(SP_MODULES), "detect.SP_MODULES must name exactly the swapped classes"
_FIX = "Use sp_size=1 for this model, or the transformers version hf_sp_trainer is tested with."
_REASONS: dict[Callable, str] = {
    _conv_entry: "the exact SP causal conv1d of hybrid layers (each document's conv across the SP ranks)",
    _gdn_entry: "the exact SP chunked delta rule (recurrent state passed across the SP ranks)",
    _mamba2_entry: "the exact SP Mamba2 chunk scan (recurrent state passed across the SP ranks)",
    _unfused_entry: "switch Mamba2's fused whole-layer path off under SP (the layer falls back to the swapped kernels)",
    _decode_only_entry: "refuse cached-decoding kernels inside an SP forward (SP runs without a cache)",
}
# Entries with nothing to check: outside an SP forward they call the installed function unchanged, inside one they
# raise instead of calling it, so no property of the installed function is relied on.
_UNCHECKED: dict[Callable, str] = {
    _decode_only_entry: "outside SP it calls the installed function unchanged; under SP it raises instead of running",
}


def check_fused_fallback(fn: Callable) -> None:
    """transformers' torch fallback of the fused whole-layer Mamba2 path (the hub wrapper's ``__wrapped__``) returns
    ``None``, which the layer reads as 'no fused path': what the SP entry returns under SP."""
    fallback = getattr(fn, "__wrapped__", fn)
    required = [
        p.name
        for p in inspect.signature(fallback).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if fallback(**dict.fromkeys(required)) is not None:
        raise ValueError(f"{fallback.__module__}.{fallback.__name__}'s torch fallback no longer returns None")


def attach_mixers(model: torch.nn.Module, documents: DocumentHook, state_passing: str = "gather") -> list[str]:
    """Swap the SP kernels into ``model``'s modeling modules (idempotent) and give ``model``'s layers, through its
    decoder pre-hook ``documents``, the context they run with (its topology: ``None`` at sp_size 1, documents kept
    apart within the process; ``state_passing``: one of ``STATE_PASSING``); returns ``module.function`` for every
    swapped function."""
    check_state_passing(state_passing)
    device = _parameter_device(model)
    swapped = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if module is None or not module_name.startswith("transformers.models."):
            continue
        for name, entry in {**ENTRIES, **dict.fromkeys(DECODE_ONLY_KERNELS, _decode_only_entry)}.items():
            if getattr(module, name, None) is None:
                continue
            if name in _CHECKS:
                check, unchecked = functools.partial(_kernel_check, module_name, name, device), None
            elif entry is _unfused_entry:
                check, unchecked = check_fused_fallback, None
            else:
                check, unchecked = None, _UNCHECKED[entry]
            patches.patch(module, name, wrap=entry, check=check, unchecked=unchecked, reason=_REASONS[entry], fix=_FIX)
            swapped.append(f"{module_name}.{name}")
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__):
        if cls.__name__ in MODULE_ENTRIES:
            patches.patch(
                cls,
                "forward",
                wrap=MODULE_ENTRIES[cls.__name__],
                check=functools.partial(check_module, cls),
                reason="the exact SP version of this mixer's forward (lightning attention, no kernel function to hook)",
                fix=_FIX,
            )
            swapped.append(f"{cls.__module__}.{cls.__name__}.forward")
    documents.context["mixers"] = MixerContext(documents.topology, documents.sharding, state_passing)
    return swapped


def check_mixer_kernels(model: torch.nn.Module) -> None:
    """The checks of ``attach_mixers`` alone, with no side effect: a ``ValueError`` before any collective. A model
    kernelized from the hub (``use_kernels=True``) may run whole hybrid layers in one fused kernel that bypasses
    the swapped functions: refused."""
    if getattr(model, "_use_kernels", False) and covered_mixers(model):
        raise ValueError(
            f"{type(model).__name__} was loaded with use_kernels=True: hub kernels may replace its hybrid layers "
            "whole, bypassing sequence parallelism's exact conv and state passing. Load it without use_kernels."
        )
    device = _parameter_device(model)
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if module is None or not module_name.startswith("transformers.models."):
            continue
        for name in ENTRIES:
            if getattr(module, name, None) is not None:
                check_kernel(module_name, name, patches.original(module, name), device)
    for cls in {type(m) for m in model.modules()}:
        if cls.__name__ in MODULE_ENTRIES:
            check_module(cls, patches.original(cls, "forward"))


def _parameter_device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def dispatch_device(device: torch.device | str | None) -> str | None:
    """Where the kernel a hub wrapper dispatches to (flash-linear-attention's, mamba-ssm's Triton kernels) can run for
    a model on ``device``: that CUDA device, or the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set
    before Python starts: the GPU-kernel test tier); ``None``: not here (the wrapper's torch path is what runs)."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return str(device)
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def check_kernel(module_name: str, name: str, fn: Callable, device: torch.device | str | None = None) -> None:
    """Raise unless the installed ``fn`` still computes what its SP version relies on (a small input): transformers'
    torch path (``__wrapped__`` of its hub wrapper) on CPU, and, for the ``DISPATCHED`` kernels, ``fn`` itself as it
    will run for a model on ``device`` (``dispatch_device``): with flash-linear-attention or mamba-ssm installed, their
    kernel. Elsewhere (CPU without the interpreter) the torch path is what runs."""
    check = _CHECKS.get(name)
    if check is None:
        return
    torch_path = getattr(fn, "__wrapped__", fn)
    runs = [(torch_path, "cpu", "")]
    target = dispatch_device(device)
    if name in DISPATCHED and target is not None and (fn is not torch_path or target != "cpu"):
        runs.append((fn, target, f" (the kernel it dispatches to, on {target})"))
    for impl, where, what in runs:
        if not check(impl, where):
            raise ValueError(
                f"{module_name}.{name}{what} no longer computes what hf_sp_trainer's sequence-parallel version of it "
                "assumes (this transformers or kernel package version changed it); use sp_size=1 for this model or "
                "a supported version."
            )


def check_module(cls: type, forward: Callable) -> None:
    """Raise unless the installed ``cls.forward`` still computes what its SP replacement computes (a small
    instance of ``cls`` on a CPU input: each document alone, as the replacement runs it at sp_size 1)."""
    if not _MODULE_CHECKS[cls.__name__](cls, forward):
        raise ValueError(
            f"{cls.__module__}.{cls.__name__}.forward no longer computes what hf_sp_trainer's sequence-parallel "
            "version of it assumes (this transformers version changed it); use sp_size=1 for this model or a "
            "supported transformers."
        )


@functools.cache
def _lightning_ok(cls: type, forward: Callable) -> bool:
    """Two documents (of 10 and 9 tokens, blocks of 4: three blocks each, partial ones, a start inside one)
    through the replacement at sp_size 1 equal the installed forward run on each document alone."""
    module_globals = sys.modules[cls.__module__]
    config_cls = next(v for k, v in vars(module_globals).items() if k.endswith("Config") and isinstance(v, type))
    config = config_cls(
        hidden_size=16, num_attention_heads=2, head_dim=8, num_hidden_layers=2, block_size=4,
        layer_types=["linear_attention", "full_attention"], intermediate_size=16, vocab_size=8,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = cls(config, 0).float()
        hidden = torch.randn(1, 19, 16)
    with torch.no_grad():
        alone = torch.cat([forward(layer, hidden[:, s:e], None, None)[0] for s, e in ((0, 10), (10, 19))], dim=1)
        runs = shard_runs(torch.tensor([0, 10, 19]), 1, SequenceSharding(1), 0)
        padding = module_globals.apply_mask_to_padding_states
        ours = lightning_forward(layer, hidden, None, runs, None, padding)[0]
    return float((ours - alone).norm()) <= 1e-5 * float(alone.norm())


_MODULE_CHECKS: dict[str, Callable[[type, Callable], bool]] = {"MiniMaxLightningAttention": _lightning_ok}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to fp32 round-off; on CUDA, where Triton's dots take fp32 through TF32 (a 10-bit mantissa), to 1e-2: a
    broken identity is off by O(1)."""
    return torch.allclose(a, b, rtol=1e-2, atol=1e-2) if a.is_cuda else torch.allclose(a, b, atol=1e-5)


def _on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


@functools.cache
def _conv_ok(fn: Callable, device: str = "cpu") -> bool:
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 7, generator=gen), torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    x, w, b = _on(device, x, w, b)
    expected = F.silu(F.conv1d(x, w.unsqueeze(1), b, padding=3, groups=3)[..., :7])
    return torch.allclose(fn(x, w, bias=b, activation="silu"), expected, atol=1e-6)  # only run on CPU


@functools.cache
def _gdn_ok(fn: Callable, device: str = "cpu", channel_decay: bool = False) -> bool:
    """Affine in the initial state, column by column: what the SP delta rule's ``[v | 0]`` / ``[0 | I]`` call uses
    (``channel_decay``: KDA's decay per key channel, ``g [b, s, heads, k]``); and a split with the state handed over
    equal to the whole run (a kernel ignoring ``initial_state`` is affine too)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 10, 2, 16, generator=gen)
    v, zeros = torch.randn(1, 10, 2, 16, generator=gen), torch.zeros(1, 10, 2, 16)
    g = -torch.rand(1, 10, 2, *((16,) if channel_decay else ()), generator=gen)
    beta, s0 = torch.rand(1, 10, 2, generator=gen), torch.randn(1, 2, 16, 16, generator=gen)
    q, k, v, zeros, g, beta, s0 = _on(device, q, k, v, zeros, g, beta, s0)
    run = functools.partial(fn, chunk_size=4, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = run(q, k, v, g=g, beta=beta, initial_state=s0)  # past q, k, v by name: FLA's differ from ours
    out_v, final_v = run(q, k, v, g=g, beta=beta, initial_state=None)
    out_s, final_s = run(q, k, zeros, g=g, beta=beta, initial_state=s0)
    first, mid = run(q[:, :6], k[:, :6], v[:, :6], g=g[:, :6], beta=beta[:, :6], initial_state=s0)
    rest, end = run(q[:, 6:], k[:, 6:], v[:, 6:], g=g[:, 6:], beta=beta[:, 6:], initial_state=mid)
    return (
        _close(out, out_v + out_s)
        and _close(final, final_v + final_s)
        and _close(torch.cat([first, rest], 1), out)
        and _close(end, final)
    )


@functools.cache
def _mamba2_ok(fn: Callable, device: str = "cpu") -> bool:
    """Affine in the initial state with the per-head decay ``exp(A sum dt)`` of ``step_sizes`` (``dt_bias``,
    softplus, the clamp: a limit that bites), and a split with the state handed over equal to the whole scan."""
    gen = torch.Generator().manual_seed(0)
    x, zeros = torch.randn(1, 11, 2, 8, generator=gen), torch.zeros(1, 11, 2, 8)
    dt, A = torch.randn(1, 11, 2, generator=gen), -torch.rand(2, generator=gen) - 0.5
    B, C = torch.randn(2, 1, 11, 1, 16, generator=gen)
    D, bias, s0 = torch.randn(2, generator=gen), torch.randn(2, generator=gen), torch.randn(1, 2, 8, 16, generator=gen)
    x, zeros, dt, A, B, C, D, bias, s0 = _on(device, x, zeros, dt, A, B, C, D, bias, s0)
    opts = dict(chunk_size=8, dt_bias=bias, dt_softplus=True, dt_limit=(0.2, 1.5), return_final_states=True)
    out, final = fn(x, dt=dt, A=A, B=B, C=C, D=D, initial_states=s0, **opts)  # past x by name: mamba_ssm's differs
    out_x, final_x = fn(x, dt=dt, A=A, B=B, C=C, D=D, initial_states=None, **opts)
    out_s, _ = fn(zeros, dt=dt, A=A, B=B, C=C, D=None, initial_states=s0, **opts)
    decay = run_decay(A, step_sizes(dt, bias, True, (0.2, 1.5))[0])[:, None, None]
    head, tail = fn(x[:, :5], dt=dt[:, :5], A=A, B=B[:, :5], C=C[:, :5], D=D, initial_states=s0, **opts)
    rest, end = fn(x[:, 5:], dt=dt[:, 5:], A=A, B=B[:, 5:], C=C[:, 5:], D=D, initial_states=tail, **opts)
    return (
        _close(out, out_x + out_s)
        and _close(final, final_x + decay * s0)
        and _close(torch.cat([head, rest], 1), out)
        and _close(end, final)
    )


_CHECKS: dict[str, Callable[[Callable, str], bool]] = {  # (the function, the device to run it on) -> ok
    "causal_conv1d_fn": _conv_ok,
    "torch_chunk_gated_delta_rule": _gdn_ok,
    "mamba2_chunk_scan": _mamba2_ok,
    "chunk_kimi_delta_attention": lambda fn, device: _gdn_ok(fn, device, channel_decay=True),
}
