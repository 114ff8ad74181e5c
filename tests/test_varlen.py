"""The varlen paths of the delta rule (``mixers/gated_deltanet.py``, ``cu_seqlens``) and of Mamba2's scan
(``mixers/mamba2.py``, ``seq_idx``): when they are taken, and their pieces.
Its exactness runs in ``tests/test_mixers.py`` (``gdn_varlen_*``: transformers' torch kernel behind a ``cu_seqlens``
interface) and in the interpreter tier on FLA's own ``cu_seqlens`` kernels (``tests/interpreter``)."""

from __future__ import annotations

import pytest
import torch

from hf_sp_trainer.mixers.linear_state import laid_end_to_end
from hf_sp_trainer.mixers.varlen_checks import _seq_idx_ok, _varlen_ok, seq_idx_capable, varlen_capable
from hf_sp_trainer.model import hub_functions
from tests.mixer_harness import GDN, KDA, SCAN, segmentwise_seq_idx, segmentwise_varlen

pytestmark = pytest.mark.unit  # in-process


def test_transformers_torch_path_is_run_segment_by_segment() -> None:
    """transformers' torch delta rule refuses ``cu_seqlens``; and on the CPU without Triton's interpreter nothing
    else can run, so the check is not even tried there."""
    assert not _varlen_ok(GDN, "cpu", False)
    assert not _varlen_ok(KDA, "cpu", True)
    assert not varlen_capable(segmentwise_varlen(GDN), "cpu")


@pytest.mark.parametrize("kernel, channel_decay", [(GDN, False), (KDA, True)], ids=["gdn", "kda"])
def test_a_kernel_keeping_segments_apart_passes(kernel, channel_decay: bool) -> None:
    assert _varlen_ok(segmentwise_varlen(kernel), "cpu", channel_decay)


def test_a_kernel_mixing_segments_fails() -> None:
    """Taking ``cu_seqlens`` but running the pieces as one sequence (from the first state) is refused."""
    torch_path = hub_functions.torch_path(GDN)

    def mixing(q, k, v, g, beta, initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None, **kw):
        return torch_path(q, k, v, g=g, beta=beta, initial_state=initial_state[:1], **kw)

    def first_state_only(q, k, v, g, beta, initial_state=None, cu_seqlens=None, **kw):
        if cu_seqlens is not None:
            initial_state = initial_state[:1].expand(len(cu_seqlens) - 1, -1, -1, -1)
        return segmentwise_varlen(GDN)(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, **kw)

    assert not _varlen_ok(mixing, "cpu", False)
    assert not _varlen_ok(first_state_only, "cpu", False)


def test_laid_end_to_end() -> None:
    t = torch.arange(2 * 6 * 3.0).view(2, 6, 3)
    following = [(0, slice(2, 4)), (0, slice(4, 6)), (1, slice(0, 5))]  # in memory order: a view
    got = laid_end_to_end(t, following)
    assert got.data_ptr() == t[0, 2].data_ptr() and torch.equal(got[0], torch.cat([t[0, 2:6], t[1, :5]]))
    apart = [(0, slice(0, 2)), (1, slice(3, 6))]
    assert torch.equal(laid_end_to_end(t, apart)[0], torch.cat([t[0, :2], t[1, 3:]]))


def test_mamba2_torch_path_is_run_segment_by_segment() -> None:
    assert not _seq_idx_ok(SCAN, "cpu")
    assert not seq_idx_capable(segmentwise_seq_idx(SCAN), "cpu")  # no kernel that could take it runs here
    assert _seq_idx_ok(segmentwise_seq_idx(SCAN), "cpu")


def test_a_scan_ignoring_seq_idx_fails() -> None:
    torch_path = hub_functions.torch_path(SCAN)

    def through(x, dt, A, B, C, seq_idx=None, **kw):  # takes seq_idx, carries the state over the cut
        return torch_path(x, dt, A, B, C, **kw)

    assert not _seq_idx_ok(through, "cpu")
