"""Behaviour check of MiniMax-M3's installed block-sparse attention before SP swaps its indexer (``checks``'s
``_MODULE_CHECKS``): what ``attention/block_sparse.py`` relies on, on a small CPU input."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface

from ..attention.block_sparse import (
    block_keep,
    block_selected_attention,
    document_positions,
    m3_projection,
    sp_block_topk,
)
from ..attention.dsa import document_causal
from .check_parts import random_module, rotary_embedding

BLOCK_CHECK_KEY = "hf_sp_block_sparse_check"  # the attention key the check registers (SP's block attention)
_DOCS = ((0, 10), (10, 23))  # two documents: blocks of 3 keys, partial ones, the second starting inside a block


def _parts(cls: type):
    """A small MiniMax-M3-shaped config of ``cls``'s modeling module (2 KV groups, blocks of 3 keys, the top-2 blocks
    and 1 local block), its sparse attention layer with random weights, and its rotary embedding."""
    modeling = sys.modules[cls.__module__]
    config_cls = next(v for k, v in vars(modeling).items() if k.endswith("TextConfig") and isinstance(v, type))
    config = config_cls(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rotary_dim=4, index_n_heads=2,
        index_head_dim=8, index_block_size=3, index_topk_blocks=2, index_local_blocks=1, num_hidden_layers=1,
        layer_types=["minimax_m3_sparse"], intermediate_size=16, vocab_size=8, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    config._attn_implementation = "eager"
    attention_cls = getattr(modeling, cls.__name__.removesuffix("Indexer") + "Attention")
    return random_module(attention_cls, config), rotary_embedding(cls, config)


def _selected(selection: torch.Tensor, bounds: torch.Tensor, size: int) -> torch.Tensor:
    """``[G, seq, seq]`` bool: the visible keys of each query's selected blocks (one row of documents)."""
    docs, positions = document_positions(bounds, 1, int(bounds[-1]), selection.device)
    blocks = positions // size
    keep = block_keep(selection, blocks, int(blocks.max()) + 1)
    return (keep & document_causal(docs, torch.arange(docs.shape[1]))[:, None])[0]


@functools.cache
def block_sparse_ok(cls: type, forward: Callable) -> bool:
    """The installed indexer (``forward``) on each document alone selects the blocks ``sp_block_topk`` selects for
    the documents packed (no group), and the installed attention hands them to a non-eager kernel as
    ``block_indices``: with SP's block attention as that kernel it equals its own eager path on a document."""
    layer, rotary = _parts(cls)
    indexer, size = layer.indexer, layer.indexer.block_size
    hidden = torch.randn(1, 23, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.zeros(2, 23, 23, dtype=torch.bool)
        for s, e in _DOCS:
            positions = torch.arange(e - s)[None]
            alone = forward(indexer, hidden[:, s:e], rotary(hidden[:, s:e], positions), None, positions)
            expected[:, s:e, s:e] = _selected(alone[0][None], torch.tensor([0, e - s]), size)
        positions = torch.cat([torch.arange(e - s) for s, e in _DOCS])[None]
        bounds = torch.tensor([0, 10, 23])
        picked = sp_block_topk(indexer, m3_projection(indexer, hidden, rotary(hidden, positions)), bounds, None, 0)
        selects = (
            bool(expected.any()) and not bool(expected.all()) and torch.equal(_selected(picked, bounds, size), expected)
        )
    return selects and _attention_ok(layer, rotary, hidden[:, :10])


def _attention_ok(layer, rotary, hidden: torch.Tensor) -> bool:
    n = hidden.shape[1]
    embeddings, bounds = rotary(hidden, torch.arange(n)[None]), torch.tensor([0, n])
    causal = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    handed = []

    def kernel(module, q, k, v, mask, dropout=0.0, scaling=None, block_indices=None, **kwargs):
        handed.append(block_indices is not None)
        if block_indices is None:
            return torch.zeros_like(q).transpose(1, 2), None
        size = module.indexer.block_size
        return block_selected_attention(q, k, v, block_indices, size, q.shape[1], 0, bounds, scaling), None

    AttentionInterface.register(BLOCK_CHECK_KEY, kernel)
    with torch.no_grad():
        reference = layer(hidden_states=hidden, position_embeddings=embeddings, attention_mask=causal[None, None])[0]
        layer.config._attn_implementation = BLOCK_CHECK_KEY
        ours = layer(hidden_states=hidden, position_embeddings=embeddings, attention_mask=None)[0]
    return handed == [True] and torch.allclose(ours, reference, atol=1e-5)
