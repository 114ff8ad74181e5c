"""``checks.check_kernel`` runs the implementation SP will run: under ``TRITON_INTERPRET=1`` (as for a model on CUDA) it
checks the kernel transformers' hub wrapper dispatches to (FLA's, mamba_ssm's) as well as transformers' torch path.
The installed kernels pass; a dispatch target that breaks what the SP algorithm relies on is refused."""

from __future__ import annotations

import functools

import pytest
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite
from transformers.models.kimi_linear import modeling_kimi_linear as kimi
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

from hf_sp_trainer.mixers.checks import DISPATCHED, _gdn_ok, check_kernel, dispatch_device
from tests.interpreter.kernels import dispatched, hub_wrapper
from tests.interpreter.shims import cuda_calls_on_cpu

pytestmark = [pytest.mark.triton_interpret, pytest.mark.unit]

KERNELS = {
    "torch_chunk_gated_delta_rule": qwen,
    "chunk_kimi_delta_attention": kimi,
    "mamba2_chunk_scan": granite,
}


def test_the_dispatched_kernels_are_checked_here() -> None:
    assert set(KERNELS) == set(DISPATCHED)
    assert dispatch_device("cpu") == "cpu", "under the interpreter the dispatched kernels run on CPU"


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_installed_kernels_pass_the_check(name: str) -> None:
    fn = hub_wrapper(getattr(KERNELS[name], name))
    assert dispatched(fn).__module__.startswith(("fla.", "mamba_ssm.")), dispatched(fn)
    with cuda_calls_on_cpu():
        check_kernel(KERNELS[name].__name__, name, fn, "cpu")


def _broken(fn):
    """``fn`` (a hub wrapper) with its dispatch target ignoring the initial state (the torch path intact): what a
    release that dropped ``initial_state`` from FLA's kernel would look like to SP."""

    @functools.wraps(fn)  # keeps ``__wrapped__``: transformers' torch function
    def broken(*args, initial_state=None, **kwargs):
        return fn(*args, **kwargs)

    return broken


def test_a_broken_dispatch_target_is_refused() -> None:
    fn = _broken(hub_wrapper(qwen.torch_chunk_gated_delta_rule))
    assert _gdn_ok(fn.__wrapped__, "cpu"), "the torch path is intact: only checking the dispatch target catches it"
    with pytest.raises(ValueError, match="the kernel it dispatches to, on cpu"):
        check_kernel("qwen3_5", "torch_chunk_gated_delta_rule", fn, "cpu")
