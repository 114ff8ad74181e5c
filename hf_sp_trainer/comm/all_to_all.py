"""Communication primitives of Ulysses sequence parallelism.

Every buffer handed to a collective is contiguous: gloo silently writes garbage into non-contiguous outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk j of ``scatter_dim`` goes to rank j; what rank j sends lands as the j-th piece of ``gather_dim``.

    One copy into the send buffer, laid out in ``x``'s own memory order (chunk index first), and the result a view of
    the receive buffer whenever the strides allow: for q, k, v (``[1, h, s/P, d]`` views of transformers'
    ``[1, s/P, h, d]`` projections) the received ``[1, h/P, s, d]`` is such a view, so nothing is stacked,
    concatenated or made contiguous around the communication.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return x
    send, order = _send_buffer(x, scatter_dim, world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return _received(recv, order, gather_dim)


def _send_buffer(x: torch.Tensor, scatter_dim: int, world: int) -> tuple[torch.Tensor, list[int]]:
    chunks = x.unflatten(scatter_dim, (world, -1)).movedim(scatter_dim, 0)  # [P, ...]: chunk j goes to rank j
    order = sorted(range(1, chunks.ndim), key=lambda i: -chunks.stride(i))  # x's memory order
    return chunks.permute(0, *order).contiguous(), order


def _received(recv: torch.Tensor, order: list[int], gather_dim: int) -> torch.Tensor:
    received = recv.permute(0, *(1 + order.index(i) for i in range(1, recv.ndim)))  # back to [P, ...] (a view)
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)  # chunk j came from rank j


@torch.library.custom_op("hf_sp_trainer::all_to_all", mutates_args=())
def all_to_all_op(x: torch.Tensor, scatter_dim: int, gather_dim: int, group_name: str) -> torch.Tensor:
    """The all-to-all as one dispatcher op, opaque to ``torch.compile`` (no graph break inside a decoder layer) and
    saveable by selective activation checkpointing (``hf_sp_trainer.memory.checkpointing``), so that recomputing a
    layer need not communicate again. Its gradient is the inverse all-to-all, the same op with the dims swapped."""
    return _all_to_all(x, scatter_dim, gather_dim, _resolve_process_group(group_name))


@all_to_all_op.register_fake
def _(x, scatter_dim, gather_dim, group_name):
    send, order = _send_buffer(x, scatter_dim, _resolve_process_group(group_name).size())
    return _received(torch.empty_like(send), order, gather_dim)  # the real op's shape and strides


def _setup_context(ctx, inputs, output) -> None:
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group_name = inputs


def _backward(ctx, grad):
    return all_to_all_op(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group_name), None, None, None


all_to_all_op.register_autograd(_backward, setup_context=_setup_context)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Split ``x`` into P chunks along ``scatter_dim``, send chunk j to rank j, concatenate what arrives along
    ``gather_dim``. Differentiable: the backward is the inverse all-to-all."""
    if dist.get_world_size(group) == 1:
        return x
    return all_to_all_op(x, scatter_dim, gather_dim, group.group_name)


@torch.library.custom_op("hf_sp_trainer::all_to_all_packed", mutates_args=())
def all_to_all_packed_op(packed: torch.Tensor, group_name: str) -> torch.Tensor:
    """Row j of ``packed`` (``[P, n]``) goes to rank j; row j of the result came from rank j. Its own inverse, so its
    gradient is the same op; a dispatcher op like ``all_to_all_op`` (opaque to compile, saveable by selective
    checkpointing)."""
    recv = torch.empty_like(packed, memory_format=torch.contiguous_format)
    dist.all_to_all_single(recv, packed.contiguous(), group=_resolve_process_group(group_name))
    return recv


@all_to_all_packed_op.register_fake
def _(packed, group_name):
    return torch.empty_like(packed, memory_format=torch.contiguous_format)


def _packed_backward(ctx, grad):
    return all_to_all_packed_op(grad, ctx.group_name), None


def _packed_setup_context(ctx, inputs, output) -> None:
    ctx.group_name = inputs[1]


all_to_all_packed_op.register_autograd(_packed_backward, setup_context=_packed_setup_context)


def all_to_all_many(
    xs: Sequence[torch.Tensor], scatter_dim: int, gather_dim: int, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """``all_to_all`` of each of ``xs`` (Ulysses' q, k and v) in **one** collective, and one in backward.

    Each tensor's chunk for rank j is copied into row j of one ``[P, n_q + n_k + n_v]`` send buffer (one copy, as the
    single exchange makes), the buffer goes through ``all_to_all_packed_op``, and each tensor is read back from its
    columns. Shapes may differ beyond ``scatter_dim`` (GQA's kv heads, MLA's value head size); tensors of different
    dtypes or devices go one collective each. The price of the one launch: the received tensors are copied out of the
    shared buffer (a tensor's rows are ``n_q + n_k + n_v`` apart there, not its own length).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return list(xs)
    if len(xs) == 1 or len({(x.dtype, x.device) for x in xs}) > 1:
        return [all_to_all(x, scatter_dim, gather_dim, group) for x in xs]
    chunks = [x.unflatten(scatter_dim, (world, -1)).movedim(scatter_dim, 0) for x in xs]  # chunk j goes to rank j
    orders = [_copy_order(x, scatter_dim, gather_dim) for x in xs]
    views = [c.permute(0, *order) for c, order in zip(chunks, orders, strict=True)]
    sizes = [v[0].numel() for v in views]
    send = xs[0].new_empty(world, sum(sizes))
    for view, start, size in zip(views, _starts(sizes), sizes, strict=True):
        send[:, start : start + size].unflatten(1, view.shape[1:]).copy_(view)
    recv = all_to_all_packed_op(send, group.group_name)
    return [
        _received(recv[:, start : start + size].unflatten(1, view.shape[1:]), order, gather_dim)
        for view, order, start, size in zip(views, orders, _starts(sizes), sizes, strict=True)
    ]


def _copy_order(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> list[int]:
    """The order of the chunk dims (``x``'s dims, 1-based after the rank dim) in which ``x`` is copied into the send
    buffer: its memory order where it is a transpose of these two dims (transformers' ``[b, h, s, d]`` views of
    ``[b, s, h, d]``), else its logical order. Decided by contiguity, not by sorting strides (that would break a
    ``torch.compile`` graph: dynamic strides are symbolic)."""
    order = list(range(1, x.ndim + 1))
    if not x.is_contiguous() and x.transpose(scatter_dim, gather_dim).is_contiguous():
        order[scatter_dim], order[gather_dim] = order[gather_dim], order[scatter_dim]
    return order


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def all_gather_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate equally shaped tensors of every rank of ``group`` along ``dim`` (no autograd)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)
