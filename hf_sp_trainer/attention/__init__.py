"""SP attention: Ulysses all-to-all -> the inner kernel on the whole sequence, or ring attention -> all-to-all.

Submodules that import transformers load lazily (``hf_sp_trainer.attention.zigzag`` needs only torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# eager: the function shares its name with its module, which would otherwise shadow it once imported
from .all_to_all import all_gather_along, all_to_all

_EXPORTS = {
    "DocumentLayout": "layout",
    "ring_attention": "ring",
    "ULYSSES_KEY": "ulysses",
    "UlyssesAttention": "ulysses",
    "validate_model_for_sp": "ulysses",
}
__all__ = [
    "DocumentLayout",
    "ULYSSES_KEY",
    "UlyssesAttention",
    "all_gather_along",
    "all_to_all",
    "ring_attention",
    "validate_model_for_sp",
]

if TYPE_CHECKING:
    from .layout import DocumentLayout
    from .ring import ring_attention
    from .ulysses import ULYSSES_KEY, UlyssesAttention, validate_model_for_sp


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_sp_trainer.attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
