"""Which implementation a transformers kernel function runs, and a test-only switch to transformers' torch path.

With flash-linear-attention / mamba-ssm installed, transformers' hub wrapper
(``use_kernel_func_from_hub_with_fallback``) calls their kernel; its ``__wrapped__`` is transformers' own torch
function. ``torch_path`` sets a modeling module's kernel functions to that torch function for a reference run (our SP
entries included: the reference is transformers on CPU without the libraries, in the same process), and restores
them after.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator

from hf_sp_trainer.model.mixers import DECODE_ONLY_KERNELS, SP_KERNELS

KERNELS = SP_KERNELS + DECODE_ONLY_KERNELS


def hub_wrapper(fn: Callable) -> Callable:
    """transformers' hub wrapper under our SP entry (``_hf_sp_original``), if swapped."""
    return getattr(fn, "_hf_sp_original", fn)


def torch_function(fn: Callable) -> Callable:
    """transformers' torch implementation behind ``fn`` (our entry and the hub wrapper unwrapped)."""
    return getattr(hub_wrapper(fn), "__wrapped__", fn)


def dispatched(fn: Callable) -> Callable:
    """The implementation ``fn``'s hub wrapper calls (FLA's / mamba_ssm's kernel when installed)."""
    closure = inspect.getclosurevars(hub_wrapper(fn)).nonlocals
    assert "implementation" in closure, f"{fn.__qualname__}: not transformers' hub wrapper (no 'implementation')"
    return closure["implementation"]


def modeling_modules(model) -> list:
    """The transformers modeling modules of ``model``'s layers."""
    names = sorted({type(m).__module__ for m in model.modules()})
    return [sys.modules[n] for n in names if n.startswith("transformers.models.")]


@contextlib.contextmanager
def torch_path(model) -> Iterator[list[str]]:
    """Inside: every kernel function of ``model``'s modeling modules is transformers' torch function (no FLA, no
    mamba_ssm, none of our entries); yields ``module.function`` for each one switched."""
    saved = []
    for module in modeling_modules(model):
        for name in KERNELS:
            fn = getattr(module, name, None)
            if fn is not None and torch_function(fn) is not fn:
                saved.append((module, name, fn))
                setattr(module, name, torch_function(fn))
    try:
        yield [f"{m.__name__}.{n}" for m, n, _ in saved]
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
