"""Hybrid models at ``sp_size == 1``: packed documents kept apart, as under SP.

transformers' linear / SSM / conv layers see document boundaries only through collator kwargs, so with
``position_ids`` packing they carry state from one document into the next even on one device. SP keeps every
document apart; so that the same flags train the same way at every ``sp_size``, ``keep_documents_apart`` gives a
single-process hybrid model the same exact kernels (``mixers.swap``) and passes them the documents of each packed row,
derived from its ``position_ids`` by the decoder pre-hook SP uses (``documents.DocumentHook``, without a topology). No
process group is involved. MiniMax-M3's block selection (transformers' own at sp_size 1: its key blocks sit at row
slots) gets the documents too, so that a row packed from several documents is refused (``selection.py``).
"""

from __future__ import annotations

import torch

from ..documents import DocumentHook
from ..model.mixers import ROW_ANCHORED, covered_mixers
from ..sharding import SequenceSharding
from .swap import attach_mixers, check_mixer_kernels


def keep_documents_apart(model: torch.nn.Module) -> DocumentHook | None:
    """Make ``model``'s hybrid layers (if it has any SP runs exactly) compute each packed document alone; returns
    the pre-hook (``None``: nothing to do; ``documents.detach_documents(model)`` removes it). Cached generation
    (``past_key_values`` or ``use_cache=True`` given) runs transformers' own kernels."""
    if not covered_mixers(model) and not any(type(m).__name__ in ROW_ANCHORED for m in model.modules()):
        return None
    check_mixer_kernels(model)
    documents = DocumentHook(None, SequenceSharding(1))
    attach_mixers(model, documents)
    documents.attach(model)
    return documents
