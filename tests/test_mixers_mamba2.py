"""Mamba2's scan under SP (``hf_sp_trainer/mixers/mamba2.py``) against transformers' ``mamba2_chunk_scan`` run on
each document alone: output and every input's gradient, one spawned gloo group per world size running every layout
(and the layer's conv on the layouts that stress its halo); the swap's kernel check and the fused path, in process."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.models.bamba import modeling_bamba as bamba

from hf_sp_trainer.attention.ulysses import BOUNDS_KWARG
from hf_sp_trainer.mixers.swap import ENTRIES, _mamba2_ok
from tests.harness import run_distributed, unwrap_results

TOL = 1e-5
CLAMP = (0.05, 0.3)  # a time_step_limit that bites on both sides (softplus(dt + dt_bias) spans about 0.03 to 0.5)


def layouts(world: int, ring: int) -> dict[str, list[int]]:
    """``name: document lengths``; every run is 13 tokens (not a multiple of the chunk, 8) but in the last case."""
    runs = world * (2 if ring > 1 else 1)
    run = 13
    total = run * runs
    short = 2 * runs  # runs of 2 tokens: shorter than the conv's width 4
    cases = {
        "start inside a run": [5, total - 5],
        "start inside the second run": [run + 3, total - run - 3],
        "start at a run start": [run, total - run],
        "start 1 token before a run": [run - 1, total - run + 1],
        "start 2 tokens before a run": [run - 2, total - run + 2],
        "one document across every run": [1, total - 1],
        "1-token documents": [1, 1, run - 2, 1, total - run - 1],
        "runs shorter than the conv": [1, 2, short - 3],
    }
    return cases


def _all_cases(world: int, rings: list[int]) -> dict[str, dict[str, float]]:
    import datetime

    import torch.distributed as dist

    from tests.mixer_harness import check_conv, check_mamba2

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for ring in rings:
        cases = layouts(world, ring)
        for name, docs in cases.items():
            results[f"ring {ring}: {name}"] = check_mamba2(docs, ring)
            if "before" in name or "shorter" in name:
                results[f"ring {ring}: {name} (conv)"] = check_conv(docs, ring)
        docs = cases["one document across every run"]
        results[f"ring {ring}: clamped steps"] = check_mamba2(docs, ring, dt_limit=CLAMP)
        results[f"ring {ring}: chunk 4"] = check_mamba2(cases["1-token documents"], ring, chunk=4)
        results[f"ring {ring}: no state passing"] = check_mamba2(docs, ring, state_passing=False)
    return results


def _check(world: int, rings: list[int]) -> None:
    results = unwrap_results(run_distributed(world, _all_cases, world, rings, timeout=600))[0]
    for case, errors in results.items():
        worst = max(errors.values())
        if "no state passing" in case:  # the negative control: the state must matter
            assert worst > 1e-2, f"{case}: {errors}"
        else:
            assert worst <= TOL, f"{case}: {errors}"


@pytest.mark.slow
def test_mamba2_sp2() -> None:
    _check(2, [1])


@pytest.mark.slow
def test_mamba2_sp3() -> None:
    _check(3, [1])


@pytest.mark.slow
def test_mamba2_sp4_ulysses_and_ring() -> None:
    _check(4, [1, 2])


def test_kernel_check_holds_the_kernel_to_its_step_sizes() -> None:
    """The swap's check passes transformers' scan, and fails one that drops the time_step_limit clamp or the
    initial state (what the SP scan's decay and correction rely on)."""
    scan = bamba.mamba2_chunk_scan
    assert _mamba2_ok(scan)

    def unclamped(*args, dt_limit=None, **kwargs):
        return scan(*args, **kwargs)

    def stateless(*args, initial_states=None, **kwargs):
        return scan(*args, **kwargs)

    assert not _mamba2_ok(unclamped)
    assert not _mamba2_ok(stateless)


def test_fused_path_off_under_sp() -> None:
    """Under SP the fused whole-layer path returns ``None`` (the layer runs its unfused path); else it is the
    installed function."""
    calls = []

    def fused(*args, **kwargs):
        calls.append(kwargs)
        return torch.zeros(1)

    entry = ENTRIES["mamba2_split_conv1d_scan_combined"](fused)
    assert entry(torch.zeros(1), **{BOUNDS_KWARG: torch.tensor([0, 4])}) is None and not calls
    assert entry(torch.zeros(1)) is not None and len(calls) == 1


def test_scan_without_sp_is_transformers() -> None:
    """Outside an SP forward (no bounds) the swapped scan is transformers' own."""
    gen = torch.Generator().manual_seed(0)
    x, dt = torch.randn(1, 6, 2, 3, generator=gen), torch.randn(1, 6, 2, generator=gen)
    A, B, C = -torch.rand(2, generator=gen), torch.randn(1, 6, 1, 4, generator=gen), torch.randn(1, 6, 1, 4)
    original = functools.partial(bamba.mamba2_chunk_scan, chunk_size=4, dt_softplus=True)
    entry = ENTRIES["mamba2_chunk_scan"](bamba.mamba2_chunk_scan)
    assert torch.equal(entry(x, dt, A, B, C, 4, dt_softplus=True), original(x, dt, A, B, C))


MAMBA2_FAMILIES = ("bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2")


@pytest.mark.slow
@pytest.mark.parametrize(("sp", "ring"), [(2, None), (4, 2)])
def test_mamba2_families_exact(sp: int, ring: int | None) -> None:
    """The Mamba2 hybrids of the family suite (weak decay: the state reaches across ranks) exact, not refused."""
    from tests.family_harness import families, run_families

    names = [(f.model_type, f.class_name) for f in families() if f.model_type in MAMBA2_FAMILIES]
    assert len(names) == len(MAMBA2_FAMILIES)
    outcomes = unwrap_results(run_distributed(sp, run_families, names, sp, ring, timeout=900))[0]
    for model_type, outcome in outcomes.items():
        assert outcome["status"] == "exact", f"{model_type}: {outcome}"
