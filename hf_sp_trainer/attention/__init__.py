"""SP attention: Ulysses all-to-all -> the inner kernel on the whole sequence, or ring attention -> all-to-all.

Submodules load lazily (they import transformers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ring_attention": "ring",
    "ULYSSES_KEY": "ulysses",
    "UlyssesAttention": "ulysses",
}
__all__ = ["ULYSSES_KEY", "UlyssesAttention", "ring_attention"]

if TYPE_CHECKING:
    from .ring import ring_attention
    from .ulysses import ULYSSES_KEY, UlyssesAttention


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_sp_trainer.attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
