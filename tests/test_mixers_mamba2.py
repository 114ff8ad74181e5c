"""Mamba2's scan under SP (``hf_sp_trainer/mixers/mamba2.py``): the layouts its kernel-level cases run (in
``tests/test_mixers.py``'s spawned groups, against transformers' ``mamba2_chunk_scan`` on each document alone), and,
in process, the swap's kernel check and the fused path. The Mamba2 families: ``tests/test_model_families.py``."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.models.bamba import modeling_bamba as bamba

from hf_sp_trainer.documents import BOUNDS_KWARG
from hf_sp_trainer.mixers.checks import _mamba2_ok
from hf_sp_trainer.mixers.swap import ENTRIES

pytestmark = pytest.mark.unit  # in-process

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


def mamba2_cases(world: int, ring: int) -> list[tuple[str, str, dict]]:
    """``tests/test_mixers.py`` cases: every layout, the conv where its halo is stressed, a clamped ``dt``, chunk 4,
    and the negative control (``control_``: state passing off)."""
    cases = layouts(world, ring)
    out = []
    for name, docs in cases.items():
        key = f"mamba2_w{world}_ring{ring}_{name.replace(' ', '_')}"
        out.append((key, "mamba2", dict(docs=docs, ring_size=ring)))
        if "before" in name or "shorter" in name:
            out.append((f"{key}_conv", "conv", dict(rows=[docs], ring_size=ring)))
    docs = cases["one document across every run"]
    out.append((f"mamba2_w{world}_ring{ring}_clamped_steps", "mamba2", dict(docs=docs, ring_size=ring, dt_limit=CLAMP)))
    chunk4 = dict(docs=cases["1-token documents"], ring_size=ring, chunk=4)
    out.append((f"mamba2_w{world}_ring{ring}_chunk_4", "mamba2", chunk4))
    many = dict(docs=cases["1-token documents"], ring_size=ring, varlen=True)  # each run's segments in one call
    out.append((f"mamba2_w{world}_ring{ring}_varlen_1-token_documents", "mamba2", many))
    out.append(
        (f"mamba2_w{world}_ring{ring}_varlen_across_every_run", "mamba2", dict(docs=docs, ring_size=ring, varlen=True))
    )
    control = dict(docs=docs, ring_size=ring, state_passing=False)
    out.append((f"control_mamba2_w{world}_ring{ring}_no_state_passing", "mamba2", control))
    return out
