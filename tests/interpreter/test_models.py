"""Hybrid models whose layers run FLA's / mamba_ssm's Triton kernels (interpreted on CPU), under SP at sp 1, 2, 2 with
a ring and 4 (Ulysses 2 x ring 2), against transformers' torch path on each document alone: the loss and every
gradient. Also: SP attached then removed (plain forward + backward, cached ``generate``), and ``tests/mixer_harness``'s
kernel-level checks with the libraries' kernels as the core. One gloo world per size serves all of its cases.

Tolerance: the project's, 1e-5 relative on the loss and on every parameter's gradient (``family_harness.compare``).
Measured worst: about 1e-6 (``docs/gpu-kernels-on-cpu.md``); the interpreter runs the kernels in fp32 numpy, with
fp32 dots (no TF32), so they differ from the torch path by fp32 round-off only.
"""

from __future__ import annotations

import pytest

from tests.interpreter.workers import KINDS
from tests.interpreter.worlds import WORLD2, WORLD4

pytestmark = [pytest.mark.triton_interpret, pytest.mark.dist]

TOL = 1e-5


def _check(name: str, result: dict, key: str = "err") -> None:
    assert "error" not in result, f"{name}: {result['error']}"
    print(f"{name}: {key} {result[key]:.2e} at {result.get('where')} ({result['cpu_seconds']} s CPU)")
    assert result[key] <= TOL, f"{name}: {key} {result[key]:.3e} at {result.get('where')}"


@pytest.mark.parametrize("name", [c[0] for c in WORLD2 if c[1] in ("sp", "kernel", "mamba2_kernel")])
def test_sp_matches_torch_path(name: str, world2: dict) -> None:
    _check(name, world2[name])


@pytest.mark.parametrize("name", [c[0] for c in WORLD2 if "kernel" in c[1] and c[2].get("varlen")])
def test_varlen_kernel_calls(name: str, world2: dict) -> None:
    """FLA's kernels take ``cu_seqlens``: a rank's forward calls one at most three times (its segments from zero, its
    runs with no document start, the corrections) for its 3-7 document segments. mamba_ssm's scan takes ``seq_idx``:
    one call per run, plus at most one correction per run."""
    runs = 2 if "ring2" in name else 1
    bound = 2 * runs if name.startswith("mamba2") else 3
    assert 1 <= world2[name]["kernel_calls"] <= bound, world2[name]


@pytest.mark.parametrize("name", [c[0] for c in WORLD2 + WORLD4 if c[1] == "sp"])
def test_models_take_the_varlen_path(name: str, world2: dict, world4: dict) -> None:
    """The SP entry of a Qwen3.5 / Kimi-Linear layer running FLA's kernel takes the ``cu_seqlens`` path, of a
    Granite-4.0-H layer running mamba_ssm's scan the ``seq_idx`` path."""
    assert {**world2, **world4}[name]["varlen"] is True


@pytest.mark.parametrize("name", [c[0] for c in WORLD4])
def test_sp4_ring2_matches_torch_path(name: str, world4: dict) -> None:
    _check(name, world4[name])


@pytest.mark.parametrize("kind", KINDS)
def test_forward_after_sp_removed(kind: str, world2: dict) -> None:
    """Our entries stay in the modeling module after ``remove()``; without SP bounds they call the library by
    keyword (a positional ``chunk_size`` landed on FLA's ``scale``): loss, gradients and generated logits."""
    result = world2[f"{kind}_after_sp"]
    _check(f"{kind}_after_sp", result)
    _check(f"{kind}_after_sp_generate", result, "generate_err")


def test_mamba_fused_path_without_sp_fails_loudly(world2: dict) -> None:
    """Training without SP takes mamba_ssm's fused whole-layer kernel, which needs Dao's ``causal_conv1d`` CUDA
    package (not installable here): it raises, it is never silently wrong (under SP it is never called)."""
    outcome = world2["mamba2_after_sp"]["fused_train_path"]
    assert outcome.startswith("TypeError") and "NoneType" in outcome, outcome
