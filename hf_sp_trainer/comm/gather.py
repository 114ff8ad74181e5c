"""The one collective of the hybrid mixers: a differentiable all-gather of small per-rank summaries.

Forward: every rank's ``x`` stacked as ``[P, ...]``. Backward: each rank's gradient is the sum over ranks of what
they propagated into its slice (a reduce-scatter of the gathered gradient; the payloads are conv halos and
recurrent-state summaries, small and independent of the sequence length). Buffers are contiguous,
as gloo needs for inputs and outputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllGatherStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
        _gather_into(out, x.unsqueeze(0).contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad[:1])
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out[0], None


# the names torch 2.13 prefers
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_stack(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[P, *x.shape]``: ``x`` of every rank of ``group`` in rank order, with the exact gradient back to each rank."""
    if group is None or dist.get_world_size(group) == 1:  # None: sp_size 1 without a process group
        return x.unsqueeze(0)
    return _AllGatherStack.apply(x, group)
