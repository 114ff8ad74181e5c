"""What *exact* means for an fp32 comparison, the same on every host: the one rule of the family suite, the VLM
matrix and the Trainer-level cases (``judge``).

fp32 round-off is not the same on every CPU: torch's kernels (``ATEN_CPU_CAPABILITY``), MKL's and oneDNN's code paths
sum in other orders on Intel and AMD, AVX2 and AVX-512. A fixed bar on the fp32 gap alone gives a host-dependent
verdict wherever round-off approaches it (cancelling sums over tokens: hyper-connection heads, PLE norms over few
tokens). So:

1. the SP run's fp32 gap from the one-process run (relative) within ``EXACT``: exact;
2. past it (or always, for comparisons known to sit near it), the gap is round-off or an SP error, and the same
   comparison is run again wholly in float64 (the model, its inputs and the fp32 islands its code pins,
   ``Float32AsFloat64``), where round-off shrinks by ~1e-9 and an SP error does not. Then exact iff the float64 gap
   is within ``FLOAT64_EXACT`` and the fp32 gap within ``EXACT`` or ``ROUND_OFF_MULTIPLE`` times the one-process
   fp32 run's own distance from float64, measured in the same run (so that an error of fp32 alone, a wrong cast,
   fails too).

An exact SP run passes on every host (by 1 or by 2); an SP error of the sizes caught before (1e-4 to 1e-2) fails on
every host (its fp32 gap passes ``EXACT``, its float64 gap stays). ``HF_SP_EXACTNESS_LOG``: a file every verdict is
appended to as a JSON line (``scripts/exactness_profiles.py`` tabulates them per round-off profile).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.overrides import TorchFunctionMode

EXACT = 1e-5  # fp32: the relative gap a reordered sum's round-off stays within on tiny models
# float64: round-off ~1e-14 on the models, 1e-7 on the Trainer's logged loss (its running sum ``tr_loss`` is an fp32
# tensor whatever the model's dtype); an SP error keeps its size (1e-4 and more)
FLOAT64_EXACT = 1e-6
ROUND_OFF_MULTIPLE = 4  # past EXACT, the fp32 gap at most this many times the one-process fp32 run's own round-off
LOG_ENV = "HF_SP_EXACTNESS_LOG"


@dataclass(frozen=True)
class Verdict:
    """One comparison judged: ``fp32``, the SP run's relative gap in fp32 (and ``where``); past ``EXACT``, ``float64``
    (the same comparison wholly in float64) and ``round_off`` (the one-process fp32 run's own distance from float64)."""

    name: str
    fp32: float
    where: str = ""
    float64: float | None = None
    round_off: float | None = None
    control: bool = False  # a negative control's (an injected SP error): to be caught

    @property
    def exact(self) -> bool:
        if self.float64 is None or self.round_off is None:
            return self.fp32 <= EXACT
        fp32_bar = max(EXACT, ROUND_OFF_MULTIPLE * self.round_off)
        return self.float64 <= FLOAT64_EXACT and self.fp32 <= fp32_bar

    def __str__(self) -> str:
        text = f"{self.name}: fp32 {self.fp32:.2e}" + (f" at {self.where}" if self.where else "")
        if self.float64 is None:
            over = "no float64 run to tell round-off from an SP error"
            return text + (f" <= {EXACT:g}" if self.fp32 <= EXACT else f" > {EXACT:g}, {over}")
        return text + (
            f"; wholly in float64 {self.float64:.2e} (bar {FLOAT64_EXACT:g}); the one-process fp32 run's own round-off "
            f"{self.round_off:.2e} (the fp32 bar: {EXACT:g} or {ROUND_OFF_MULTIPLE} x that)"
        )


def judge(
    name: str,
    fp32: float,
    float64_run: Callable[[], tuple[float, float]] | None,
    where: str = "",
    force: bool = False,
    control: bool = False,
) -> Verdict:
    """The rule above. ``float64_run()``: ``(float64 gap, one-process fp32 round-off)``, called only past ``EXACT``
    (or with ``force``: the float64 run wanted anyway); None where the comparison has no float64 version.
    ``control``: a negative control's comparison (recorded as one)."""
    float64 = round_off = None
    if (fp32 > EXACT or force) and float64_run is not None:
        float64, round_off = float64_run()
    verdict = Verdict(name, fp32, where, float64, round_off, control)
    record(verdict)
    return verdict


def assert_exact(
    name: str, diffs: dict[str, float], float64_run: Callable[[], tuple[float, float]] | None = None
) -> Verdict:
    """``judge`` the largest of a comparison's relative differences (``diffs``: what -> figure) and assert it exact;
    the verdict."""
    where = max(diffs, key=diffs.__getitem__)
    verdict = judge(name, diffs[where], float64_run, where)
    assert verdict.exact, str(verdict)
    return verdict


def record(verdict: Verdict, path: str | None = None) -> None:
    """Append ``verdict`` to ``$HF_SP_EXACTNESS_LOG`` (nothing where it is unset; rank 0 only)."""
    import torch.distributed as dist

    path = path or os.environ.get(LOG_ENV)
    if path and not (dist.is_initialized() and dist.get_rank() != 0):  # the ranks judge alike: rank 0 records
        with open(path, "a") as f:
            f.write(json.dumps(asdict(verdict) | {"exact": verdict.exact, "profile": profile()}) + "\n")


def capped_below_amx() -> str | None:
    """Why torch's AMX kernels can't run under this round-off profile, or None: ``ATEN_CPU_CAPABILITY`` below
    AVX-512 on an AMX CPU, where torch 2.13's bf16 SDPA raises (``pack_vnni2``) and its compiled flex_attention
    segfaults. No real host has that profile (a CPU without AVX-512 has no AMX either): tests of those kernels skip."""
    capability = torch.backends.cpu.get_cpu_capability()
    if torch.cpu._is_amx_tile_supported() and capability not in ("AVX512", "ZVECTOR"):
        return f"torch's AMX kernels (bf16 SDPA, compiled flex_attention) fail on an AMX CPU capped at {capability}"
    return None


def profile() -> str:
    """The round-off profile this process runs under: the switches that change torch's CPU kernels."""
    switches = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
    return " ".join(f"{k}={os.environ[k]}" for k in switches if os.environ.get(k)) or "native"


# ----------------------------------------------------------------------------------------------------------------
# float64 runs
# ----------------------------------------------------------------------------------------------------------------
def _wider(value):
    return torch.float64 if value is torch.float32 else value


class Float32AsFloat64(TorchFunctionMode):
    """Every fp32 a torch call asks for (``.float()``, a ``torch.float32`` argument) given as float64: the fp32
    islands modeling code pins (HY-V4's hyper-connections and norms call ``.float()``), scoped, no patching."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(_wider(a) for a in args)
        kwargs = {k: _wider(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def widened(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64 (its experts on the eager path: torch's grouped_mm takes no float64)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model.double()


def float64_scope(model: torch.nn.Module):
    """Run a float64 model's own fp32 islands in float64 too (``Float32AsFloat64``); nothing for any other model."""
    floating = next((p for p in model.parameters() if p.is_floating_point()), None)
    return Float32AsFloat64() if floating is not None and floating.dtype == torch.float64 else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------------
# negative controls: an SP error of a chosen size
# ----------------------------------------------------------------------------------------------------------------
def inject_error(model: torch.nn.Module, size: float, fp32_only: bool = False) -> torch.utils.hooks.RemovableHandle:
    """Make the SP run wrong by ``size`` (relative) on the world's last rank: every other feature of its shard of the
    last decoder layer's output scaled by ``1 + size`` (a shard computed differently from one device, as the SP
    errors caught before were). ``fp32_only``: only where the layer runs in fp32 (an error of one dtype, as a wrong
    cast is)."""
    import torch.distributed as dist

    from hf_sp_trainer.model.decoder import decoder_layers, forward_decoder

    last = decoder_layers(forward_decoder(model))[-1]

    def hook(_module, _args, output):
        if not dist.is_initialized() or dist.get_rank() != dist.get_world_size() - 1:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        if fp32_only and hidden.dtype != torch.float32:
            return output
        every_other = torch.arange(hidden.shape[-1], device=hidden.device) % 2  # not a uniform scale: norms undo it
        scaled = hidden * (1 + size * every_other.to(hidden.dtype))
        return (scaled, *output[1:]) if isinstance(output, tuple) else scaled

    return last.register_forward_hook(hook)
