"""Behaviour checks of Mistral-Large-4's DeepSeek sparse attention (``MistralLarge4TextAttention`` and its
``MistralLarge4TextIndexer``) before ``mixers.swap`` swaps them (``checks._MODULE_CHECKS``).

It differs from DeepSeek-V3.2's DSA (``checks._dsa_parts``) where SP could go wrong: the indexer's queries come from
the hidden states and are scaled per head by ``scale * log(position + 1) + bias`` (the attention's queries too), so
both read each token's position in its document (``position_ids``); NoPE layers (``no_rope_layers``) rotate neither
queries nor keys; a ``"shared"`` layer (``indexer_types``) reuses the previous layer's top-k (``prev_topk_indices``);
the attention's forward takes ``shared_kv_states`` and ``position_ids`` and returns its top-k as a third output.
Checked on a RoPE layer, a NoPE layer and (the attention) a shared layer, with random weights (the query scaling's
``scale`` and ``bias`` included) and positions counted from each document's start.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface

from ..attention.dsa import POSITIONAL_PROJECTIONS, document_causal, document_ids, selected_attention, sp_index_topk

CHECK_KEY = "hf_sp_positional_dsa_check"  # the attention key the check registers (a plain kernel on selected keys)
LAYERS = (0, 1, 2)  # RoPE with its own indexer, NoPE with its own indexer, RoPE reusing the previous top-k


def positional_dsa_parts(cls: type, layer: int):
    """``cls(config, layer)`` (the attention or the indexer) of a small config of its modeling module (top-4 of 9-
    and 11-token documents, 8 indexer heads: no score ties at the 4th place), random weights, its rotary embedding."""
    modeling = sys.modules[cls.__module__]
    family = cls.__name__.removesuffix("Attention").removesuffix("Indexer")  # MistralLarge4Text
    config = getattr(modeling, f"{family}Config")(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, index_n_heads=8, index_head_dim=8, index_topk=4, num_hidden_layers=3,
        intermediate_size=16, moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, vocab_size=8,
        no_rope_layers=[1, 0, 1], indexer_types=["full", "full", "shared"],
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(layer)
        module = cls(config, layer).float().eval()
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.3)
        rotary = next(v for k, v in vars(modeling).items() if k.endswith("RotaryEmbedding"))(config)
        torch.nn.init.normal_(rotary.alpha, std=0.3)  # LeRoPE's learned frequency scaling
    return module, rotary


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@functools.cache
def positional_indexer_ok(cls: type, forward: Callable) -> bool:
    """On a RoPE and a NoPE layer: two packed documents (9 and 11 tokens, positions from each start) through
    ``sp_index_topk`` (no group) select, among each query's visible keys, what the installed indexer selects on each
    document alone."""
    docs, bounds = ((0, 9), (9, 20)), torch.tensor([0, 9, 20])
    positions = torch.cat([torch.arange(e - s) for s, e in docs])[None]
    visible = document_causal(document_ids(bounds, 1, 20, "cpu"), torch.arange(20))[0]
    for layer in LAYERS[:2]:
        indexer, rotary = positional_dsa_parts(cls, layer)
        hidden = torch.randn(1, 20, 32, generator=torch.Generator().manual_seed(layer))
        with torch.no_grad():
            expected = torch.zeros(20, 20, dtype=torch.bool)
            for s, e in docs:
                n, alone = e - s, torch.arange(e - s)[None]
                picks = forward(
                    indexer, hidden_states=hidden[:, s:e], position_embeddings=rotary(hidden[:, s:e], alone),
                    attention_mask=_causal(n)[None], position_ids=alone,
                )  # fmt: skip
                chosen = torch.zeros(n, n, dtype=torch.bool).scatter_(-1, picks[0].long(), True)
                expected[s:e, s:e] = chosen & _causal(n)
            project = POSITIONAL_PROJECTIONS[cls.__name__]
            projected = project(indexer, hidden, rotary(hidden, positions), positions)
            picks = sp_index_topk(indexer, projected, bounds, None, 0)
            got = torch.zeros(20, 20, dtype=torch.bool).scatter_(-1, picks[0].long(), True) & visible
        if not expected.any() or not torch.equal(got, expected):
            return False
    return True


@functools.cache
def positional_attention_ok(cls: type, forward: Callable) -> bool:
    """On a RoPE, a NoPE and a shared layer: the installed forward (given the mask it slices for its indexer, the
    kv-sharing dict and the document positions) hands its top-k (its indexer's, or the previous layer's) to a
    non-eager kernel as ``indices=`` and returns it; with ``selected_attention`` as that kernel it equals its own
    eager path on a document."""
    hidden = torch.randn(1, 11, 32, generator=torch.Generator().manual_seed(0))
    positions, bounds = torch.arange(11)[None], torch.tensor([0, 11])
    causal = torch.zeros(11, 11).masked_fill(~_causal(11), torch.finfo(torch.float32).min)[None, None]  # additive
    previous = torch.randint(0, 11, (1, 11, 4), generator=torch.Generator().manual_seed(1)).to(torch.int32)
    previous[..., 0] = torch.arange(11)  # a shared layer's top-k: every query keeps a visible key (itself)
    handed = []

    def kernel(module, q, k, v, mask, dropout=0.0, scaling=None, indices=None, **kwargs):
        handed.append(indices is not None)
        if indices is None:  # what SP's attention would then attend: every visible key
            indices = torch.arange(q.shape[2]).expand(q.shape[0], q.shape[2], -1)
        return selected_attention(q, k, v, indices, bounds, scaling), None

    AttentionInterface.register(CHECK_KEY, kernel)
    for layer_idx in LAYERS:
        layer, rotary = positional_dsa_parts(cls, layer_idx)
        run = functools.partial(
            forward, layer, hidden_states=hidden, position_embeddings=rotary(hidden, positions), attention_mask=causal,
            position_ids=positions, prev_topk_indices=previous if layer.indexer is None else None,
        )  # fmt: skip
        with torch.no_grad():
            reference = run(shared_kv_states={})
            layer.config._attn_implementation = CHECK_KEY
            ours = run(shared_kv_states={})
        same_topk = torch.equal(ours[2], reference[2]) and (layer.indexer is not None or torch.equal(ours[2], previous))
        if not (same_topk and torch.allclose(ours[0], reference[0], atol=1e-5)):
            return False
    return handed == [True] * len(LAYERS)
