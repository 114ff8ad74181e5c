"""Data shipped with the package: an offline tokenizer (and the main job's model config and dataset)."""

from .tokenizer import build_char_tokenizer

__all__ = ["build_char_tokenizer"]
