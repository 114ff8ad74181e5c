"""Behaviour checks of Qwen4-Exp's installed query-sparse attention before SP swaps it (``checks``'s
``_MODULE_CHECKS``): what ``attention/qsa.py`` relies on, on a small CPU input."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface

from ..attention.dsa import document_causal, document_ids, selected_attention, selected_positions
from ..attention.qsa import qsa_projection, sp_qsa_select
from .check_parts import random_module, rotary_embedding

QSA_CHECK_KEY = "hf_sp_qsa_check"  # the attention key the check registers (SP's selected-keys attention)
_DOCS = ((0, 11), (11, 24))  # two documents: blocks of 3 tokens, incomplete tails, the second starting mid-block


def _parts(cls: type):
    """A small Qwen4-Exp-shaped config of ``cls``'s modeling module (blocks of 3 tokens, the top-2 blocks; 8 indexer
    heads: no score ties at the 2nd place), its sparse attention layer with random weights, its rotary embedding."""
    modeling = sys.modules[cls.__module__]
    config_cls = next(v for k, v in vars(modeling).items() if k.endswith("TextConfig") and isinstance(v, type))
    config = config_cls(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, indexer_n_heads=8,
        indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=6, indexer_compress_ratio=3, num_hidden_layers=1,
        intermediate_size=16, vocab_size=8,
    )  # fmt: skip
    config._attn_implementation = "eager"
    attention_cls = getattr(modeling, cls.__name__.removesuffix("QSAIndexer").removesuffix("Attention") + "Attention")
    return random_module(attention_cls, config), rotary_embedding(cls, config)


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def _document_causal(bounds: torch.Tensor, seq: int) -> torch.Tensor:
    return document_causal(document_ids(bounds, 1, seq, "cpu"), torch.arange(seq))


def _visible(picks: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return selected_positions(picks, picks.shape[1])[:, 0] & _document_causal(bounds, picks.shape[1])


@functools.cache
def qsa_indexer_ok(cls: type, forward: Callable) -> bool:
    """Two packed documents through ``sp_qsa_select`` (no group) select, among each query's visible keys, the
    tokens the installed indexer (``forward``) selects on each document alone."""
    layer, rotary = _parts(cls)
    hidden = torch.randn(1, 24, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.zeros(1, 24, 24, dtype=torch.bool)
        for s, e in _DOCS:
            n = e - s
            embeddings = rotary(hidden[:, s:e], torch.arange(n)[None])
            expected[:, s:e, s:e] = forward(layer.indexer, hidden[:, s:e], embeddings, _causal(n), None)[:, 0]
        positions = torch.cat([torch.arange(e - s) for s, e in _DOCS])[None]
        embeddings, bounds = rotary(hidden, positions), torch.tensor([0, 11, 24])
        picks = sp_qsa_select(layer.indexer, qsa_projection(layer.indexer, hidden, embeddings), embeddings, bounds,
                              None, 0)  # fmt: skip
        got = _visible(picks, bounds)
    sparse = bool((expected.sum(-1) < _document_causal(bounds, 24).sum(-1)).any())  # the budget binds
    return sparse and torch.equal(got, expected)


@functools.cache
def qsa_attention_ok(cls: type, forward: Callable) -> bool:
    """The installed forward (``forward``), given a one-element mask, its indexer returning one, and the selection as
    ``indices=``, hands them to a non-eager kernel: with ``selected_attention`` as that kernel it equals its own eager
    path on a document."""
    layer, rotary = _parts(cls)
    n = 11
    hidden = torch.randn(1, n, 32, generator=torch.Generator().manual_seed(0))
    embeddings, bounds = rotary(hidden, torch.arange(n)[None]), torch.tensor([0, n])
    handed = []

    def kernel(module, q, k, v, mask, dropout=0.0, scaling=None, indices=None, **kwargs):
        handed.append(indices is not None and mask.numel() == 1)
        if indices is None:
            return torch.zeros_like(q).transpose(1, 2), None
        return selected_attention(q, k, v, indices, bounds, scaling), None

    AttentionInterface.register(QSA_CHECK_KEY, kernel)
    one = torch.ones((), dtype=torch.bool)
    with torch.no_grad():
        additive = torch.zeros(n, n).masked_fill(~_causal(n), torch.finfo(torch.float32).min)  # eager's mask
        reference = forward(layer, hidden_states=hidden, position_embeddings=embeddings, attention_mask=additive)[0]
        picks = sp_qsa_select(layer.indexer, qsa_projection(layer.indexer, hidden, embeddings), embeddings, bounds,
                              None, 0)  # fmt: skip
        layer.config._attn_implementation = QSA_CHECK_KEY
        layer.indexer.forward = lambda *args, **kwargs: one  # what SP's indexer returns (the attention selected)
        ours = forward(layer, hidden_states=hidden, position_embeddings=embeddings, attention_mask=one, indices=picks)
    return handed == [True] and torch.allclose(ours[0], reference, atol=1e-5)
