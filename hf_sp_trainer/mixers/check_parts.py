"""Small random modules for the behaviour checks (``checks``, ``block_checks``): what a check runs the installed code
on, built the same way for every check so that its figures are reproducible."""

from __future__ import annotations

import sys

import torch


def random_module(cls: type, config, layer: int = 0) -> torch.nn.Module:
    """``cls(config, layer)`` in fp32 eval mode, every parameter drawn from N(0, 0.3²) under seed 0 (the global RNG
    left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = cls(config, layer).float().eval()
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.3)
    return module


def rotary_embedding(cls: type, config) -> torch.nn.Module:
    """The rotary embedding of ``cls``'s modeling module, for ``config``."""
    modeling = sys.modules[cls.__module__]
    return next(v for k, v in vars(modeling).items() if k.endswith("RotaryEmbedding"))(config)
