"""transformers' module-level kernel functions as the ``kernels`` package makes them (transformers >= 5.25).

From 5.25 a modeling module's kernel function (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ...) is a
``kernels`` hub function: an ``nn.Module`` instance (``Func``, no ``__wrapped__``) whose call runs, inside a layer
listed by ``use_kernelized_func``, that layer's private copy (which ``kernelize`` may point at a hub kernel), and
elsewhere the decorated function itself. Before 5.25 (or without ``kernels`` installed) the name holds the function.

SP needs the function beneath, in one place: the SP versions call what the swap checked (``plain_function``, never a
kernel ``kernelize`` picked later for a layer), read transformers' torch path (``torch_path``), and refuse a mixer layer
whose whole forward a hub kernel replaced (``hub_replaced_layers``: such a layer never calls the swapped functions).
The ``kernels`` members relied on (the ``Func`` forward's closure cell ``func``, ``kernel_layer_name``) are named in
``tests/test_upstream_contract.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def _closure_function(fn: torch.nn.Module) -> Callable | None:
    forward = type(fn).__dict__.get("forward")
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or not cells or "func" not in code.co_freevars:
        return None
    return cells[code.co_freevars.index("func")].cell_contents


def plain_function(fn: Callable) -> Callable:
    """The function a hub function runs when nothing is kernelized (transformers' decorated function: its torch code,
    or, for ``use_kernel_func_from_hub_with_fallback``, its dispatch to an installed package); ``fn`` itself
    otherwise."""
    if isinstance(fn, torch.nn.Module) and hasattr(type(fn), "kernel_layer_name"):
        inner = _closure_function(fn)
        if inner is None:
            raise ValueError(
                f"{type(fn).__qualname__} is a kernels hub function whose decorated function hf_sp_trainer can't find "
                "(its forward no longer closes over `func`): this kernels version is not supported."
            )
        return inner
    return fn


def torch_path(fn: Callable) -> Callable:
    """transformers' torch implementation of ``fn``: beneath a hub function and beneath the dispatch of
    ``use_kernel_func_from_hub_with_fallback`` (its ``__wrapped__``)."""
    plain = plain_function(fn)
    return getattr(plain, "__wrapped__", plain)


def function_name(fn: Callable) -> str:
    """``module.function`` of ``fn`` (of the function beneath a hub function)."""
    plain = plain_function(fn)
    return f"{getattr(plain, '__module__', '?')}.{getattr(plain, '__qualname__', type(plain).__name__)}"


def hub_replaced_layers(
    modules: Iterable[tuple[str, torch.nn.Module]], originals: Iterable[Callable] = ()
) -> list[str]:
    """Paths of the modules whose ``forward`` ``kernelize`` replaced by a hub kernel's: an instance ``forward`` bound
    to another function than its class's (or one of ``originals``, the class's forward before a patch; ``kernelize``
    binds the class's forward itself where it found no kernel)."""
    replaced = []
    for name, module in modules:
        bound = module.__dict__.get("forward")
        if bound is None:
            continue
        func = getattr(bound, "__func__", bound)
        if func is not type(module).forward and func not in tuple(originals):
            replaced.append(name)
    return replaced
