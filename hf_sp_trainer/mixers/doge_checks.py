"""Behaviour check of Doge's installed attention (``DogeAttention``) before SP swaps its forward (``checks``'s
``_MODULE_CHECKS``).

Where SP could go wrong: the projections, norms and RoPE, ``dt`` (``A``, softplus, ``dt_proj`` of every kv head's
values), which keys the dynamic mask keeps (the top ``keep_window_size`` by ``dt`` among a query's visible keys, per
kv head), the bias it adds, the sliding window the model's mask applies, GQA. Checked with random weights on documents
of 13 and 18 tokens (the top 5 kept), with and without a window of 7, against the installed forward (eager) on each
document alone.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from ..attention.doge import doge_attention_forward
from .check_parts import close, random_module, rotary_embedding

DOCS = ((0, 13), (13, 31))
KEEP = 5


def doge_parts(cls: type, window: int | None):
    """``(attention, rotary embedding)`` of a small config of ``cls``'s modeling module (4 query heads on 2 kv heads,
    the top ``KEEP`` keys kept, ``window``), random weights, eager attention."""
    config = sys.modules[cls.__module__].DogeConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, keep_window_size=KEEP, sliding_window=window,
        num_hidden_layers=1, intermediate_size=16, vocab_size=8,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return random_module(cls, config), rotary_embedding(cls, config)


def document_mask(n: int, window: int | None) -> torch.Tensor:
    """``[1, 1, n, n]`` bool: what the model's mask lets a query of a document alone see (causal, the window)."""
    i = torch.arange(n)
    keep = i[None] <= i[:, None]
    return (keep & (i[:, None] - i[None] < window) if window else keep)[None, None]


@functools.cache
def doge_attention_ok(cls: type, forward: Callable) -> bool:
    """Two packed documents through ``doge_attention_forward`` (no group) give what the installed forward gives
    each document alone, with and without a window."""
    seq = DOCS[-1][1]
    hidden = torch.randn(1, seq, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(e - s) for s, e in DOCS])[None]
    bounds = torch.tensor([0, *(e for _, e in DOCS)])
    ok = []
    for window in (None, 7):
        attn, rotary = doge_parts(cls, window)
        with torch.no_grad():
            alone = []
            for s, e in DOCS:
                embeddings = rotary(hidden[:, s:e], torch.arange(e - s)[None])
                mask = document_mask(e - s, window)
                alone.append(forward(attn, hidden[:, s:e], embeddings, attention_mask=mask)[0])
            ours = doge_attention_forward(attn, hidden, rotary(hidden, positions), bounds, None)
        ok.append(close(ours, torch.cat(alone, dim=1)))
    return all(ok)


__all__ = ["doge_attention_ok", "doge_parts"]
