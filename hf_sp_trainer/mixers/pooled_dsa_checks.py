"""Behaviour checks of GLM-5-Next's pooled DeepSeek sparse attention (``Glm5NextTextIndexer``,
``Glm5NextTextAttention``) before ``mixers.swap`` swaps them (``checks._MODULE_CHECKS``).

Where SP could go wrong: the pools (their size, their gated average, counted from a document's start, complete ones
only, visible when their last token is), the number of pools a query takes, the tail of its own incomplete pool, the
``-1`` padding, the queries and keys the indexer projects (no RoPE); and the attention's projections, its shared
layers reusing the previous layer's top-k, its returned top-k. Checked with random weights on documents of 13 and 18
tokens (pools of 4, the best 2 taken, the tail on), against the installed classes on each document alone.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface

from ..attention.dsa import document_causal, document_ids, selected_attention, selected_positions
from ..attention.pooled_dsa import glm5_next_attention_forward, pooled_projection, sp_pooled_topk

CHECK_KEY = "hf_sp_pooled_dsa_check"  # the attention key the check registers (a plain kernel on selected keys)
DOCS = ((0, 13), (13, 31))


def pooled_dsa_parts(cls: type, layer: int = 0, tail: bool = True):
    """``cls(config, layer)`` (the attention or the indexer) of a small config of its modeling module (pools of 4,
    the best 2 of them, 8 indexer heads; layer 1 reuses layer 0's top-k), with random weights."""
    modeling = sys.modules[cls.__module__]
    family = cls.__name__.removesuffix("Attention").removesuffix("Indexer")  # Glm5NextText
    config = getattr(modeling, f"{family}Config")(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=8,
        qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8, index_n_heads=8, index_head_dim=8, index_topk=8,
        index_kpool=4, index_kpool_always_select_tail=tail, num_hidden_layers=2, intermediate_size=16,
        moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, vocab_size=8, pad_token_id=0,
        layer_types=["indexed_attention"] * 2, indexer_types=["full", "shared"], mlp_layer_types=["dense"] * 2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(layer + 10 * tail)
        module = cls(config, layer).float().eval()
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.3)
    return module


def _selected(picks: torch.Tensor, n: int) -> torch.Tensor:
    """``[rows, n]`` bool: the keys ``picks`` (``[rows, width]``, ``-1`` padded) selects."""
    return selected_positions(picks[None], n)[0, 0]


@functools.cache
def pooled_indexer_ok(cls: type, forward: Callable) -> bool:
    """With and without the tail: two packed documents through ``sp_pooled_topk`` (no group) select, per query, the
    keys the installed indexer selects on each document alone (its selection within the query's visible keys), and
    the pools act (the selection is not every visible key)."""
    bounds = torch.tensor([0, *(e for _, e in DOCS)])
    seq = DOCS[-1][1]
    visible = document_causal(document_ids(bounds, 1, seq, "cpu"), torch.arange(seq))[0]
    for tail in (True, False):
        indexer = pooled_dsa_parts(cls, 0, tail)
        hidden = torch.randn(1, seq, 32, generator=torch.Generator().manual_seed(int(tail)))
        q_resid = torch.randn(1, seq, 16, generator=torch.Generator().manual_seed(2 + int(tail)))
        with torch.no_grad():
            expected = torch.zeros(seq, seq, dtype=torch.bool)
            for s, e in DOCS:
                mask = torch.ones(1, e - s, dtype=torch.bool)
                picks = forward(
                    indexer, hidden_states=hidden[:, s:e], q_resid=q_resid[:, s:e], attention_mask=mask, cache=None
                )
                expected[s:e, s:e] = _selected(picks[0], e - s)
            picks = sp_pooled_topk(indexer, pooled_projection(indexer, hidden, q_resid), bounds, None, 0)
            got = _selected(picks[0], seq)
        if not torch.equal(got, expected) or not torch.equal(got & visible, got) or torch.equal(got, visible):
            return False
    return True


@functools.cache
def pooled_attention_ok(cls: type, forward: Callable) -> bool:
    """On a layer with its own indexer and a shared one: ``glm5_next_attention_forward`` hands its top-k (its
    indexer's, the previous layer's) to a non-eager kernel as ``indices=`` and returns it as the installed forward
    does; with ``selected_attention`` as that kernel it equals the installed eager forward on a document."""
    n = 13
    hidden = torch.randn(1, n, 32, generator=torch.Generator().manual_seed(0))
    bounds, mask = torch.tensor([0, n]), torch.ones(1, n, dtype=torch.bool)
    previous = torch.randint(0, n, (1, n, 11), generator=torch.Generator().manual_seed(1)).to(torch.int32)
    previous = torch.minimum(previous, torch.arange(n, dtype=torch.int32)[:, None])  # an indexer's: causal
    previous[..., 0] = torch.arange(n)  # a shared layer's top-k: every query keeps a visible key (itself)
    previous[..., -1] = -1  # and the padding a selection may hold
    handed = []

    def kernel(module, q, k, v, attention_mask, dropout=0.0, scaling=None, indices=None, **kwargs):
        handed.append(indices is not None)
        return selected_attention(q, k, v, indices, bounds, scaling), None

    AttentionInterface.register(CHECK_KEY, kernel)
    for layer_idx in (0, 1):
        layer = pooled_dsa_parts(cls, layer_idx)
        prev = previous if layer.indexer is None else None
        with torch.no_grad():
            reference = forward(layer, hidden_states=hidden, attention_mask=mask, prev_topk_indices=prev)
            layer.config._attn_implementation = CHECK_KEY
            ours = glm5_next_attention_forward(layer, hidden, attention_mask=mask, prev_topk_indices=prev)
        if (reference[2] is None) != (ours[2] is None) or not torch.allclose(ours[0], reference[0], atol=1e-5):
            return False
        if ours[2] is not None and not torch.equal(ours[2], reference[2]):
            return False
    return handed == [True, True]


__all__ = ["pooled_attention_ok", "pooled_indexer_ok"]
