"""Behaviour check of DeepSeek-V4's installed attention before SP swaps its forward (``checks``'s
``_MODULE_CHECKS``): ``attention/deepseek_v4.py`` on two packed documents (no group) gives what the installed forward
gives each document alone, for a sliding, a CSA and an HCA layer, on a small CPU input."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from ..attention.deepseek_v4 import v4_attention_forward
from .check_parts import close

_DOCS = ((0, 11), (11, 29))  # windows of 2 and 4 tokens, the second document starting mid-window
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def _model(cls: type):
    """A small DeepSeek-V4 of ``cls``'s modeling module (window 5, CSA every 2 tokens with the top 3, HCA every 4),
    random weights, eager attention."""
    modeling = sys.modules[cls.__module__]
    config = modeling.DeepseekV4Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16, qk_rope_head_dim=8,
        q_lora_rank=16, o_groups=2, o_lora_rank=8, index_n_heads=4, index_head_dim=8, index_topk=3,
        sliding_window=5, compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        num_hidden_layers=3, layer_types=LAYER_TYPES, mlp_layer_types=["moe"] * 3, intermediate_size=32,
        moe_intermediate_size=16, num_local_experts=2, num_experts_per_tok=1, vocab_size=8,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = modeling.DeepseekV4Model(config).float().eval()
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.3)
    return model


def _embeddings(model, hidden, positions):
    return {kind: model.rotary_emb(hidden, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}


def _sliding_mask(n: int, window: int) -> torch.Tensor:
    i = torch.arange(n)
    keep = (i[None] <= i[:, None]) & (i[:, None] - i[None] < window)
    return torch.zeros(n, n).masked_fill(~keep, float("-inf"))[None, None]


@functools.cache
def v4_attention_ok(cls: type, forward: Callable) -> bool:
    model = _model(cls)
    hidden = torch.randn(1, 29, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(e - s) for s, e in _DOCS])[None]
    bounds = torch.tensor([0, 11, 29])
    ok = []
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            alone = []
            for s, e in _DOCS:
                n = e - s
                alone.append(forward(attn, hidden_states=hidden[:, s:e],
                                     position_embeddings=_embeddings(model, hidden[:, s:e], torch.arange(n)[None]),
                                     position_ids=torch.arange(n)[None],
                                     attention_mask=_sliding_mask(n, attn.sliding_window))[0])  # fmt: skip
            ours = v4_attention_forward(attn, hidden, _embeddings(model, hidden, positions), positions, bounds, None, 0)
            ok.append(close(ours, torch.cat(alone, dim=1)))
    return all(ok)
