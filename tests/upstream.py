"""What the installed transformers has, for tests that depend on its version (the supported range: setup.py)."""

from __future__ import annotations

import importlib
from types import ModuleType

import transformers
from packaging.version import Version

VERSION = Version(transformers.__version__)
# transformers 5.24 named the cache argument of attention / indexer forwards `cache` (before: `past_key_values`):
# the selection swaps (DSA, QSA, block-sparse, pooled DSA) and Qwen4-Exp's token history take it, so on earlier
# versions those families are refused under SP (mixers/swap.py, test_mixers_detect.py)
CACHE_ARGUMENT = VERSION >= Version("5.24")
BEFORE_CACHE_ARGUMENT = "before transformers 5.24 these modules take past_key_values: refused under SP"


def family_module(name: str) -> ModuleType | None:
    """``transformers.models.<name>.modeling_<name>``, or ``None`` where this transformers lacks the family."""
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None


def has_families(*names: str) -> bool:
    return all(family_module(n) is not None for n in names)
