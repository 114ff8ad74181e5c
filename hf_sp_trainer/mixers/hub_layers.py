"""What SP checks of the installed transformers where releases differ (used by ``swap``): the cache argument of the
modules it swaps a method of (``cache`` from 5.24, ``past_key_values`` before), the layer-level functions of 5.25
(``causal_conv1d_forward``, ...: read, as the mixer detection reads a layer), and the hub kernels ``kernelize`` may put
in place of a mixer layer (``use_kernels``, transformers' default from 5.25)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from .. import patches
from ..model.hub_functions import hub_replaced_layers, plain_function
from ..model.mixers import covered_mixers, layer_function_problem


def check_layer_function(fn: Callable) -> None:
    """The function beneath the installed layer-level function mixes the sequence only through the swapped kernels
    (a reading of its code, as the mixer detection reads a layer's forward)."""
    problem = layer_function_problem(plain_function(fn))
    if problem:
        raise ValueError(problem)


def check_cache_argument(cls: type, attr: str, entry: Callable[[Callable], Callable], installed: Callable) -> None:
    """An entry that takes the ``cache`` argument (the name transformers gives the cache from 5.24) needs an installed
    method that takes it too (before 5.24 these modules take ``past_key_values``, and their callers pass it so),
    unless both take ``**kwargs``: else the call would fail, so refused, naming the version."""
    takes = inspect.signature(entry(installed), follow_wrapped=False).parameters
    installed_takes = inspect.signature(installed).parameters

    def open_ended(parameters) -> bool:  # a **kwargs: the other name passes through harmlessly (SP runs cacheless)
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())

    renamed = "cache" in takes and "cache" not in installed_takes and "past_key_values" in installed_takes
    if renamed and not (open_ended(takes) and open_ended(installed_takes)):
        raise ValueError(
            f"{cls.__module__}.{cls.__name__}.{attr} takes past_key_values (transformers before 5.24), where "
            "hf_sp_trainer's sequence-parallel version of it takes the cache as `cache`: use transformers >= 5.24 "
            "for this model under SP, or sp_size=1."
        )


def hub_layer_check(model: torch.nn.Module) -> Callable[[], None]:
    """A check of ``model``'s covered mixer layers. A model kernelized from the hub (``use_kernels=True``,
    transformers' default from 5.25) keeps its hybrid layers unless ``kernelize`` found a hub kernel for a mixer
    layer's whole forward on its device: that layer would never reach the swapped functions. ``attach_mixers`` runs
    it, and ``DocumentHook`` before every SP forward's first collective (``model.train()`` / ``eval()`` kernelize
    again). A hub kernel for one of the swapped functions needs no check: under SP the swap calls the function it
    checked."""
    covered = covered_mixers(model)
    mixers = [(n, m) for n, m in model.named_modules() if n in covered and hasattr(type(m), "kernel_layer_name")]
    originals = [f for _, m in mixers if (f := getattr(type(m).forward, patches.ORIGINAL_ATTR, None)) is not None]
    # names only, no reference to the model: the check lives in its decoder's hook (which must not keep it alive)
    name, classes = type(model).__name__, {n: type(m).__name__ for n, m in mixers}

    def check() -> None:
        replaced = hub_replaced_layers(mixers, originals)
        if replaced:
            layer = classes[replaced[0]]
            raise ValueError(
                f"{name}: {replaced[0]} ({layer}) runs a hub kernel in place of its forward (kernelize, from "
                "use_kernels=True on this device), which would bypass sequence parallelism's exact conv and state "
                "passing. Call model.reset_kernels() (or load with use_kernels=False, or a KernelConfig whose "
                "mapping leaves this layer out) before training with SP."
            )

    return check
