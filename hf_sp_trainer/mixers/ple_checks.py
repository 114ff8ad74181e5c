"""Behaviour checks of Qwen4-Exp's installed per-layer embedding (PLE) before SP swaps its parts (``checks``'s
``_MODULE_CHECKS``): what ``token_history`` relies on, on a small CPU input."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from ..sharding import SequenceSharding
from .check_parts import close
from .runs import shard_runs
from .token_history import document_ngrams, sp_dilated_conv

_DOCS = ((0, 7), (7, 18))  # the second document holds an EOS token and crosses the sp-2 boundary (9)
EOS = 2


def _ple_layer(cls: type):
    """A small Qwen4-Exp-shaped PLE layer of ``cls``'s modeling module (trigrams, a conv of kernel 3 and dilation 3),
    random weights."""
    modeling = sys.modules[cls.__module__]
    config_cls = next(v for k, v in vars(modeling).items() if k.endswith("TextConfig") and isinstance(v, type))
    config = config_cls(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_hidden_layers=1,
        intermediate_size=16, vocab_size=32, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=16,
        ple_embed_dim=8, ple_conv_kernel_size=3, hc_count=2, ple_layer_ids=[1], eos_token_id=EOS,
        make_ngram_vocab_size_divisible_by=8,
    )  # fmt: skip
    layer_cls = getattr(modeling, cls.__name__.replace("NGramEmbedding", "PLELayer"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = layer_cls(config, 0, 0).float().eval()
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.3)
    return layer


def _runs(rank: int, sp_size: int):
    return shard_runs(torch.tensor([0, 7, 18]), 1, SequenceSharding(sp_size, 1), rank)


@functools.cache
def ngram_ok(cls: type, forward: Callable) -> bool:
    """The installed n-gram embedding (``forward``) run on each document piece of a rank with its document's ids in
    front (``document_ngrams``, sp 2, both ranks) gives what it gives each document alone, which differs from the
    packed row's (the history crosses the document start)."""
    embedding = _ple_layer(cls).ple_embedding
    ids = torch.randint(3, 32, (1, 18), generator=torch.Generator().manual_seed(0))
    ids[0, 12] = EOS
    with torch.no_grad():
        alone = torch.cat([forward(embedding, input_ids=ids[:, s:e], cache=None) for s, e in _DOCS], dim=1)
        packed = forward(embedding, input_ids=ids, cache=None)
        ours = torch.cat([document_ngrams(forward, embedding, ids, _runs(rank, 2)) for rank in (0, 1)], dim=1)
    return torch.equal(ours, alone) and not torch.equal(packed, alone)


@functools.cache
def ple_conv_ok(cls: type, forward: Callable) -> bool:
    """The installed dilated conv (``PLELayer._short_conv``, ``forward``) on each document alone equals SP's causal
    conv of its dilated weight (``sp_dilated_conv``) on the packed row."""
    layer = _ple_layer(cls)
    x = torch.randn(1, 18, layer.conv1d.in_channels, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = torch.cat([forward(layer, hidden_states=x[:, s:e], cache=None) for s, e in _DOCS], dim=1)
        ours = sp_dilated_conv(x, layer.conv1d, _runs(0, 1), None)
    return close(ours, alone)
