"""What Triton's interpreter (``TRITON_INTERPRET=1``) needs to run FLA's, Liger's and mamba_ssm's kernels on CPU
tensors (research note ``shared/design/triton-interpreter.md``; the shims' logic is from its ``common.py``).

Interpreter gaps (process-wide, installed once before the libraries are imported: ``install``):

1. the autotuner benchmarks through the active GPU driver ("0 active drivers"): equal timings, the first config runs;
2. ``for i in range(n)`` runs as a Python loop, so FLA's ``i_t.to(tl.int64)`` fails on an ``int``: the loop variable
   becomes a Triton scalar, as the interpreter already does for assignments;
3. a float kernel argument stays a Python float (Liger's ``softcap.to(tl.float32)`` fails): an fp32 scalar, as in
   compiled Triton;
4. ``triton.language.extra.libdevice`` functions are stubs only the compiler resolves (Liger's soft-capping ``tanh``):
   elementwise numpy functions of the same name.

mamba_ssm's CUDA assumptions: its package imports the CUDA extension ``selective_scan_cuda`` (a stub module, before
the import: ``install``), and its SSD wrappers call ``torch.cuda.device(t.device.index)`` (``None`` on CPU) and
``torch.cuda.get_device_properties(t.device).multi_processor_count``: both answered for CPU tensors inside
``cuda_calls_on_cpu()`` only.
"""

from __future__ import annotations

import ast
import contextlib
import os
import sys
import types
from collections.abc import Iterator

PATCHED = (
    "triton.runtime.autotuner.Autotuner.do_bench",
    "triton.runtime.interpreter.ASTTransformer",
    "triton.runtime.interpreter._implicit_cvt",
    "triton.language.extra.libdevice",
)
LIBRARIES = ("triton", "fla", "liger_kernel", "mamba_ssm")
_installed: list[bool] = []


def interpreting() -> bool:
    """Whether this process runs Triton kernels through the interpreter (the variable is read at kernel definition,
    so it must be set before Python starts)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def install() -> None:
    """Shims 1-4 and the ``selective_scan_cuda`` stub (idempotent); call before FLA / Liger / mamba_ssm are imported
    (Liger imports libdevice's ``tanh`` by name)."""
    if _installed:
        return
    if not interpreting():
        raise RuntimeError("the Triton shims are for TRITON_INTERPRET=1 only (set it before Python starts)")
    for name in ("fla", "liger_kernel", "mamba_ssm"):
        if name in sys.modules:
            raise RuntimeError(f"{name} was imported before the Triton shims were installed")
    _libdevice_as_numpy()
    _float_arguments_as_fp32()
    _autotune_first_config()
    _loop_variables_as_scalars()
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    _installed.append(True)


def _autotune_first_config() -> None:
    from triton.runtime import autotuner

    autotuner.Autotuner.do_bench = property(lambda self: lambda kernel_call, quantiles: [0.0] * len(quantiles))


def _loop_variables_as_scalars() -> None:
    from triton.runtime import interpreter

    def visit_For(self, node: ast.For) -> ast.For:
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            semantic = ast.Name(id="interpreter_semantic", ctx=ast.Load())
            to_tensor = ast.Attribute(value=semantic, attr="to_tensor", ctx=ast.Load())
            loop_variable = ast.Name(id=node.target.id, ctx=ast.Load())
            wrap = ast.Call(func=to_tensor, args=[loop_variable, ast.Constant(value=False)], keywords=[])
            node.body.insert(0, ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())], value=wrap))
        return node

    interpreter.ASTTransformer.visit_For = visit_For


def _float_arguments_as_fp32() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._implicit_cvt

    def _implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return original(arg)

    interpreter._implicit_cvt = _implicit_cvt


def _libdevice_as_numpy() -> None:
    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    def elementwise(np_fn):
        def fn(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, tl.tensor)]
            data = [a.handle.data if isinstance(a, tl.tensor) else a for a in args]
            out = np.asarray(np_fn(*data)).astype(tensors[0].handle.data.dtype)
            return tl.tensor(interpreter.TensorHandle(out, tensors[0].handle.dtype), tensors[0].type)

        return fn

    aliases = {
        "rsqrt": lambda x: 1 / np.sqrt(x), "div_rn": np.divide, "pow": np.power, "atan2": np.arctan2,
        "atan": np.arctan, "asin": np.arcsin, "acos": np.arccos, "fast_expf": np.exp, "fast_logf": np.log,
    }  # fmt: skip
    for name in dir(libdevice):
        np_fn = aliases.get(name, getattr(np, name, None))
        if not name.startswith("_") and callable(np_fn) and callable(getattr(libdevice, name)):
            setattr(libdevice, name, elementwise(np_fn))


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """mamba_ssm's two CUDA calls answered for CPU tensors while inside: ``torch.cuda.device(None)`` is a null
    context, ``get_device_properties(<cpu>)`` reports 4 multiprocessors (it sizes the backward's grid)."""
    import torch

    device, properties = torch.cuda.device, torch.cuda.get_device_properties

    def cpu_device(index):
        return contextlib.nullcontext() if index is None else device(index)

    def cpu_properties(d=None):
        if isinstance(d, torch.device) and d.type == "cpu":
            return types.SimpleNamespace(multi_processor_count=4)
        return properties(d)

    torch.cuda.device, torch.cuda.get_device_properties = cpu_device, cpu_properties
    try:
        yield
    finally:
        torch.cuda.device, torch.cuda.get_device_properties = device, properties
