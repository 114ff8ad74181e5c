"""``sequence_all_reduce``: the sum of per-rank partial sequence terms over the SP group, with autograd.

Each SP rank holds a slice of every sequence, so a sequence-level term (a log-probability summed over the completion,
the reward read at a sequence's last token) is the sum of the ranks' partial terms. Every rank then computes the same
loss ``L`` from the same reduced terms; the SP group's objective is the sum of its ranks' identical losses, ``sp * L``,
whose gradient with respect to rank ``r``'s partial terms is the sum over the group of the incoming gradients: the
backward is an all-reduce too (``sp x dL/dy``, as every rank's incoming gradient is the same).

That factor is exactly the compensation data parallelism needs: DDP, FSDP and ZeRO average gradients over all
``dp x sp`` ranks, so ``(1 / (dp sp)) sum_groups sum_ranks sp dL_g/dtheta|_rank`` is the mean over DP groups of the
full-sequence gradients, as in a plain data-parallel run (not ``1/sp`` of it). Buffers handed to gloo are contiguous.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SequenceAllReduce(torch.autograd.Function):
    """``y = sum_r x_r`` over ``group``; ``dx_r = sum_r' dy_r'`` (the gradient of the group's summed losses)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.detach().contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sequence_all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ``group``: differentiable (``SequenceAllReduce``) when ``x`` needs a gradient, else plain."""
    if dist.get_world_size(group) == 1:
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return SequenceAllReduce.apply(x, group)
    out = x.detach().contiguous().clone()
    dist.all_reduce(out, group=group)
    return out
