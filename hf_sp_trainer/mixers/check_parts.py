"""What the behaviour checks (``checks``, ``block_checks``, ``varlen_checks``) share: small random modules, built the
same way for every check so that its figures are reproducible; where a dispatched kernel can run; the comparison."""

from __future__ import annotations

import os
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


def dispatch_device(device: torch.device | str | None) -> str | None:
    """Where the kernel a hub wrapper dispatches to (flash-linear-attention's, mamba-ssm's Triton kernels) can run for
    a model on ``device``: that CUDA device, or the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set
    before Python starts: the GPU-kernel test tier); ``None``: not here (the wrapper's torch path is what runs)."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return str(device)
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to fp32 round-off; on CUDA, where Triton's dots take fp32 through TF32 (a 10-bit mantissa), to 1e-2: a
    broken identity is off by O(1)."""
    return torch.allclose(a, b, rtol=1e-2, atol=1e-2) if a.is_cuda else torch.allclose(a, b, atol=1e-5)


def on_device(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]
