"""A decoder config layer by layer: transformers' heterogeneous configs (``per_layer_config``) included.

Since transformers 5.24 a config may give some attributes per layer (Gemma4's full-attention layers have another
``head_dim`` and, with ``attention_k_eq_v``, other ``num_key_value_heads``); reading such an attribute on the global
config raises. Everything SP reads about attention heads goes through here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    """One decoder layer's attention heads."""

    heads: int
    kv_heads: int
    head_dim: int


def text_config(config):
    """The text decoder's config (a VLM's ``text_config``), or ``config`` itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_configs(config) -> list:
    """The text config of every decoder layer: ``per_layer_config[i]`` where the config is heterogeneous, else the
    text config itself (once per layer)."""
    text = text_config(config)
    layers = getattr(text, "num_hidden_layers", None) or 1
    if getattr(text, "is_heterogeneous", False):
        return [text.per_layer_config[i] for i in range(layers)]
    return [text] * layers


def attention_shapes(config) -> list[AttentionShape]:
    """Each decoder layer's query heads, kv heads and head size (``[]`` for a model without attention heads)."""
    out = []
    for layer in layer_configs(config):
        heads = getattr(layer, "num_attention_heads", None)
        if not heads:
            return []
        kv = getattr(layer, "num_key_value_heads", None) or heads
        dim = getattr(layer, "head_dim", None) or layer.hidden_size // heads
        out.append(AttentionShape(heads, kv, dim))
    return out


def head_counts(config) -> tuple[int, int]:
    """``(query heads, kv heads)`` that SP splits: the greatest common divisor of the layers' query heads (the
    Ulysses degree must divide every layer's) and the fewest kv heads of any layer."""
    shapes = attention_shapes(config)
    if not shapes:
        raise ValueError(f"{type(text_config(config)).__name__} has no attention heads.")
    return math.gcd(*(s.heads for s in shapes)), min(s.kv_heads for s in shapes)
