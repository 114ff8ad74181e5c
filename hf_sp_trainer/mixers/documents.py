"""Hybrid models at ``sp_size == 1``: packed documents kept apart, as under SP.

transformers' linear / SSM / conv layers see document boundaries only through collator kwargs, so with
``position_ids`` packing they carry state from one document into the next even on one device. SP keeps every
document apart; so that the same flags train the same way at every ``sp_size``, ``keep_documents_apart`` gives a
single-process hybrid model the same exact kernels (``mixers.swap``) and passes them the documents of each packed row,
derived from its ``position_ids`` by a pre-hook on the decoder. No process group is involved.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from ..attention.layout import DocumentLayout
from ..attention.ring import document_bounds
from ..attention.ulysses import BOUNDS_KWARG, _decoder
from .detect import covered_mixers
from .swap import attach_mixers, check_mixer_kernels


def keep_documents_apart(model: torch.nn.Module) -> RemovableHandle | None:
    """Make ``model``'s hybrid layers (if it has any SP runs exactly) compute each packed document alone; returns
    the pre-hook's handle (``None``: nothing to do). Cached generation (``past_key_values`` or ``use_cache=True``
    given) runs transformers' own kernels."""
    if not covered_mixers(model):
        return None
    check_mixer_kernels(model)
    attach_mixers(model, None)

    def before_forward(module, args, kwargs):
        if BOUNDS_KWARG in kwargs or kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            return None  # under SP (the Ulysses pre-hook gave the bounds), or decoding
        tokens = kwargs.get("input_ids", args[0] if args else None)
        tokens = tokens if tokens is not None else kwargs["inputs_embeds"]
        batch, length = tokens.shape[:2]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=tokens.device).expand(batch, -1)
        layout = DocumentLayout.from_position_ids(positions.expand(batch, -1))
        kwargs.update(use_cache=False, **{BOUNDS_KWARG: document_bounds(layout.segments, length)})
        return args, kwargs

    return _decoder(model).register_forward_pre_hook(before_forward, with_kwargs=True)
