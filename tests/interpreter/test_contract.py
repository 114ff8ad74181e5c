"""The shims' contract with the installed releases: every member ``shims.py`` patches or relies on is still where it
was, and the installed versions are the pins of ``constraints.txt``. A release that moves one fails here, naming it,
instead of as an obscure interpreter error in the kernel tests."""

from __future__ import annotations

import importlib
import inspect
import os
from importlib.metadata import version

import pytest

from tests.interpreter.shims import PATCHED

pytestmark = [pytest.mark.triton_interpret, pytest.mark.unit]

CONSTRAINTS = os.path.join(os.path.dirname(__file__), "constraints.txt")


def pins() -> dict[str, str]:
    """``distribution: version`` from ``constraints.txt``."""
    out = {}
    with open(CONSTRAINTS) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, _, pinned = line.partition("==")
                out[name.strip()] = pinned.strip()
    return out


@pytest.mark.parametrize("dist", sorted(pins()))
def test_installed_version_is_the_pin(dist: str) -> None:
    installed = version(dist).split("+")[0]  # torch's local version: 2.13.0+cpu
    assert installed == pins()[dist], f"{dist} {installed} installed, constraints.txt pins {pins()[dist]}"


def _member(path: str):
    """The object at the dotted ``path``: its longest importable module prefix, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            assert hasattr(obj, part), f"{path}: {'.'.join(parts[:split])} has no {part!r} any more"
            obj = getattr(obj, part)
        return obj
    raise AssertionError(f"{path}: {parts[0]} does not import")


@pytest.mark.parametrize("path", PATCHED)
def test_patched_members_exist(path: str) -> None:
    _member(path)


def test_autotuner_benchmarks_through_do_bench() -> None:
    autotuner = _member("triton.runtime.autotuner.Autotuner")
    do_bench = inspect.getattr_static(autotuner, "do_bench")
    assert isinstance(do_bench, property) and do_bench.fget.__module__ == "tests.interpreter.shims", (
        "shim 1 (Autotuner.do_bench) is not installed"
    )
    source = inspect.getsource(_member("triton.runtime.autotuner.Autotuner._bench"))
    assert "self.do_bench(" in source, "triton.runtime.autotuner.Autotuner._bench no longer calls self.do_bench"


def test_interpreter_rewrites_assignments_to_tensors() -> None:
    """Shim 2 adds ``visit_For`` to the interpreter's AST rewrite, mirroring its ``visit_Assign``."""
    interpreter = _member("triton.runtime.interpreter")
    transformer = _member("triton.runtime.interpreter.ASTTransformer")
    assert "interpreter_semantic" in inspect.getsource(transformer.visit_Assign), (
        "triton.runtime.interpreter.ASTTransformer.visit_Assign no longer wraps values in interpreter_semantic"
    )
    assert hasattr(interpreter, "interpreter_semantic"), "triton.runtime.interpreter.interpreter_semantic is gone"
    assert transformer.visit_For.__module__ == "tests.interpreter.shims", "shim 2 (visit_For) is not installed"
    assert hasattr(_member("triton.runtime.interpreter.FunctionRewriter"), "ast_transformer"), (
        "triton.runtime.interpreter.FunctionRewriter.ast_transformer is gone (the rewrite shim 2 extends)"
    )


def test_interpreter_converts_arguments_in_implicit_cvt() -> None:
    interpreter = _member("triton.runtime.interpreter")
    cvt = _member("triton.runtime.interpreter._implicit_cvt")
    assert cvt.__module__ == "tests.interpreter.shims", "shim 3 (_implicit_cvt) is not installed"
    assert callable(_member("triton.runtime.interpreter.TensorHandle"))
    original = inspect.getclosurevars(cvt).nonlocals["original"]
    assert original.__module__ == interpreter.__name__ and "isinstance(arg, int)" in inspect.getsource(original), (
        "triton.runtime.interpreter._implicit_cvt no longer converts int arguments (shim 3 extends it to floats)"
    )


def test_libdevice_functions_are_replaced() -> None:
    libdevice = _member("triton.language.extra.libdevice")
    for name in ("tanh", "exp", "log", "sqrt", "rsqrt"):
        fn = getattr(libdevice, name, None)
        assert fn is not None, f"triton.language.extra.libdevice.{name} is gone"
        assert fn.__module__ == "tests.interpreter.shims", f"libdevice.{name} is not shimmed (shim 4)"
    from liger_kernel.ops import cross_entropy  # imports libdevice's tanh by name

    assert cross_entropy.tanh.__module__ == "tests.interpreter.shims", "Liger imported libdevice.tanh before shim 4"


def test_mamba_cuda_calls_are_the_ones_scoped() -> None:
    """mamba_ssm's Triton SSD / state-update code makes no CUDA calls but the two ``cuda_calls_on_cpu`` answers."""
    import re

    import torch
    from mamba_ssm.ops.triton import (
        selective_state_update,
        ssd_bmm,
        ssd_chunk_scan,
        ssd_chunk_state,
        ssd_combined,
        ssd_state_passing,
    )

    from tests.interpreter.shims import cuda_calls_on_cpu

    for module in (ssd_combined, ssd_bmm, ssd_chunk_scan, ssd_chunk_state, ssd_state_passing, selective_state_update):
        calls = set(re.findall(r"torch\.cuda\.\w+", inspect.getsource(module)))
        assert calls <= {"torch.cuda.device", "torch.cuda.get_device_properties"}, f"{module.__name__}: {calls}"
    before = torch.cuda.device, torch.cuda.get_device_properties
    with cuda_calls_on_cpu():
        assert torch.cuda.get_device_properties(torch.device("cpu")).multi_processor_count > 0
        with torch.cuda.device(None):
            pass
    assert (torch.cuda.device, torch.cuda.get_device_properties) == before, "the CUDA shims leaked out of scope"


def test_liger_takes_our_keywords() -> None:
    """``fused_loss._liger_sum`` calls Liger's loss by name."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    params = list(inspect.signature(LigerFusedLinearCrossEntropyLoss.forward).parameters)
    assert params[1:] == ["lin_weight", "_input", "target", "bias"], params
    init = inspect.signature(LigerFusedLinearCrossEntropyLoss.__init__).parameters
    assert {"ignore_index", "reduction", "softcap"} <= set(init), list(init)


def test_transformers_dispatches_to_the_libraries() -> None:
    """With the libraries installed, transformers' kernel functions run theirs (the tier tests those paths)."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    from tests.interpreter.kernels import dispatched

    expected = {
        (qwen, "torch_chunk_gated_delta_rule"): "fla.ops.gated_delta_rule",
        (qwen, "torch_recurrent_gated_delta_rule"): "fla.ops.gated_delta_rule",
        (kimi, "chunk_kimi_delta_attention"): "fla.ops.kda",
        (kimi, "recurrent_kimi_delta_attention"): "fla.ops.kda",
        (granite, "mamba2_chunk_scan"): "mamba_ssm.ops.triton.ssd_combined",
        (granite, "mamba2_split_conv1d_scan_combined"): "mamba_ssm.ops.triton.ssd_combined",
        (granite, "mamba2_selective_state_update"): "mamba_ssm.ops.triton.selective_state_update",
    }
    for (module, name), package in expected.items():
        target = dispatched(getattr(module, name))
        assert target.__module__.startswith(package), f"{module.__name__}.{name} dispatches to {target.__module__}"
