"""Ulysses attention: all-to-all -> inner kernel on the full sequence -> all-to-all."""

from .all_to_all import all_gather_along, all_to_all
from .layout import DocumentLayout
from .ulysses import ULYSSES_KEY, UlyssesAttention, validate_model_for_sp

__all__ = [
    "ULYSSES_KEY",
    "DocumentLayout",
    "UlyssesAttention",
    "all_gather_along",
    "all_to_all",
    "validate_model_for_sp",
]
