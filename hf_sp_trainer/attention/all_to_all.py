"""Communication primitives of Ulysses sequence parallelism.

Every buffer handed to a collective is contiguous: gloo silently writes garbage into non-contiguous outputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    send = torch.stack(x.chunk(world, dim=scatter_dim))  # [world, ...]: chunk j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # chunk j came from rank j


@torch.library.custom_op("hf_sp_trainer::all_to_all", mutates_args=())
def all_to_all_op(x: torch.Tensor, scatter_dim: int, gather_dim: int, group_name: str) -> torch.Tensor:
    """The forward all-to-all as one dispatcher op: selective activation checkpointing can then save its result
    (``hf_sp_trainer.memory.checkpointing``) instead of communicating again when a layer is recomputed."""
    return _all_to_all(x, scatter_dim, gather_dim, _resolve_process_group(group_name))


@all_to_all_op.register_fake
def _(x, scatter_dim, gather_dim, group_name):
    shape = list(x.shape)
    world = _resolve_process_group(group_name).size()
    shape[scatter_dim], shape[gather_dim] = shape[scatter_dim] // world, shape[gather_dim] * world
    return x.new_empty(shape)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):  # type: ignore[override]
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        if dist.get_world_size(group) == 1:
            return x
        return all_to_all_op(x, scatter_dim, gather_dim, group.group_name)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Split ``x`` into P chunks along ``scatter_dim``, send chunk j to rank j, concatenate what arrives along
    ``gather_dim``. Differentiable: the backward is the inverse all-to-all."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def all_gather_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate equally shaped tensors of every rank of ``group`` along ``dim`` (no autograd)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)
