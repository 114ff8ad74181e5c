"""Kernel-level exactness of the hybrid mixers under SP: random inputs of one packed row, each SP rank runs its
shard through the SP kernel, against transformers' own kernel run on each document alone (one process)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.models.bamba import modeling_bamba as bamba
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from hf_sp_trainer.attention.ring import document_bounds
from hf_sp_trainer.mixers.causal_conv import sp_causal_conv1d
from hf_sp_trainer.mixers.gated_deltanet import sp_chunk_gated_delta_rule
from hf_sp_trainer.mixers.mamba2 import sp_mamba2_chunk_scan
from hf_sp_trainer.mixers.runs import shard_runs
from hf_sp_trainer.sharding import SequenceSharding
from hf_sp_trainer.topology import sp_topology

CONV = qwen3_5.causal_conv1d_fn
GDN = qwen3_5.torch_chunk_gated_delta_rule
SCAN = bamba.mamba2_chunk_scan


def _segments(docs: list[int]) -> list[tuple[int, int]]:
    edges = [0]
    for d in docs:
        edges.append(edges[-1] + d)
    return list(zip(edges[:-1], edges[1:], strict=True))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def gdn_inputs(
    total: int, heads: int = 2, k_dim: int = 8, v_dim: int = 6, decay: float = 0.05, seed: int = 0, k_heads: int = 0
):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total, k_heads or heads, k_dim, generator=gen)
    k = torch.randn(1, total, k_heads or heads, k_dim, generator=gen)
    v = torch.randn(1, total, heads, v_dim, generator=gen)
    g = -decay * torch.rand(1, total, heads, generator=gen)  # weak decay: long-range state matters
    beta = torch.rand(1, total, heads, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def conv_inputs(total: int, channels: int = 5, width: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, channels, total, generator=gen)
    w = torch.randn(channels, width, generator=gen)
    b = torch.randn(channels, generator=gen)
    return [t.requires_grad_() for t in (x, w, b)]


def check_gdn(
    docs: list[int], ring_size: int, chunk: int = 64, state_passing: bool = True, decay: float = 0.05, k_heads: int = 0
) -> dict[str, float]:
    """Max relative difference of the output and of every input's gradient, SP vs document by document."""
    topo = sp_topology(dist.get_world_size(), ring_size)
    sharding = SequenceSharding(topo.sp_size, ring_size)
    total = sum(docs)
    inputs = gdn_inputs(total, decay=decay, k_heads=k_heads)
    weight = torch.randn(1, total, inputs[2].shape[2], inputs[2].shape[3], generator=torch.Generator().manual_seed(1))
    opts = dict(chunk_size=chunk, use_qk_l2norm_in_kernel=True)
    ref = torch.cat([GDN(*(t[:, s:e] for t in inputs), **opts)[0] for s, e in _segments(docs)], 1)
    (ref * weight).sum().backward()
    ref_grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    index = sharding.positions(total, topo.sp_rank)
    local = [t.detach()[:, index].clone().requires_grad_() for t in inputs]
    bounds = document_bounds([_segments(docs)], total)
    runs = shard_runs(bounds, 1, sharding, topo.sp_rank)
    core = GDN if state_passing else _no_state(GDN)
    out, _ = sp_chunk_gated_delta_rule(
        lambda *a, **kw: core(*a, chunk_size=chunk, **kw), *local, runs, topo.sp_group, use_qk_l2norm_in_kernel=True
    )
    (out * weight[:, index]).sum().backward()
    result = {"out": _rel(out.detach(), ref.detach()[:, index])}
    for name, t, g in zip(("q", "k", "v", "g", "beta"), local, ref_grads, strict=True):
        result[name] = _rel(t.grad, g[:, index])
    return _max_over_ranks(result)


def _no_state(core):
    def without(*args, initial_state=None, **kwargs):  # negative control: every run starts from zero
        if initial_state is not None:
            initial_state = (
                torch.zeros_like(initial_state) if initial_state.shape[-1] != initial_state.shape[-2] else initial_state
            )
        return core(*args, initial_state=initial_state, **kwargs)

    return without


def check_conv(docs: list[int], ring_size: int, width: int = 4) -> dict[str, float]:
    topo = sp_topology(dist.get_world_size(), ring_size)
    sharding = SequenceSharding(topo.sp_size, ring_size)
    total = sum(docs)
    x, w, b = conv_inputs(total, width=width)
    weight = torch.randn(1, x.shape[1], total, generator=torch.Generator().manual_seed(1))
    ref = torch.cat([CONV(x[:, :, s:e], w, b, activation="silu") for s, e in _segments(docs)], -1)
    (ref * weight).sum().backward()
    ref_grads = [x.grad.clone(), w.grad.clone(), b.grad.clone()]
    index = sharding.positions(total, topo.sp_rank)
    xl = x.detach()[:, :, index].clone().requires_grad_()
    wl, bl = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    bounds = document_bounds([_segments(docs)], total)
    runs = shard_runs(bounds, 1, sharding, topo.sp_rank)
    out = sp_causal_conv1d(xl, wl, bl, "silu", runs, topo.sp_group)
    (out * weight[:, :, index]).sum().backward()
    for t in (wl, bl):  # parameter gradients are partial per rank: summed like SP's gradient reduction
        dist.all_reduce(t.grad)
    result = {
        "out": _rel(out.detach(), ref.detach()[:, :, index]),
        "x": _rel(xl.grad, ref_grads[0][:, :, index]),
        "weight": _rel(wl.grad, ref_grads[1]),
        "bias": _rel(bl.grad, ref_grads[2]),
    }
    return _max_over_ranks(result)


MAMBA2_NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias")


def mamba2_inputs(total: int, heads: int = 4, head_dim: int = 3, groups: int = 2, state: int = 5, seed: int = 0):
    """Random scan inputs with weak decay: ``softplus(dt + dt_bias)`` about 0.03 to 0.5, ``A`` in [-0.3, -0.1]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, total, heads, head_dim, generator=gen)
    dt = torch.randn(1, total, heads, generator=gen)
    A = -0.1 - 0.2 * torch.rand(heads, generator=gen)
    B = torch.randn(1, total, groups, state, generator=gen)
    C = torch.randn(1, total, groups, state, generator=gen)
    D = torch.randn(heads, generator=gen)
    dt_bias = -2.0 + 0.1 * torch.randn(heads, generator=gen)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D, dt_bias)]


def check_mamba2(
    docs: list[int],
    ring_size: int,
    chunk: int = 8,
    state_passing: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> dict[str, float]:
    """Max relative difference of the scan's output and of every input's gradient, SP vs document by document
    (transformers' ``mamba2_chunk_scan``, softplus on, ``dt_limit`` as given)."""
    topo = sp_topology(dist.get_world_size(), ring_size)
    sharding = SequenceSharding(topo.sp_size, ring_size)
    total = sum(docs)
    inputs = mamba2_inputs(total)
    x, dt, A, B, C, D, dt_bias = inputs
    opts = dict(chunk_size=chunk, dt_softplus=True, dt_limit=dt_limit)
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    ref = torch.cat(
        [
            SCAN(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], D=D, dt_bias=dt_bias, **opts)
            for s, e in _segments(docs)
        ],
        1,
    )
    (ref * weight).sum().backward()
    ref_grads = [t.grad.clone() for t in inputs]
    index = sharding.positions(total, topo.sp_rank)
    seq = [t.detach()[:, index].clone().requires_grad_() for t in (x, dt, B, C)]
    params = [t.detach().clone().requires_grad_() for t in (A, D, dt_bias)]
    bounds = document_bounds([_segments(docs)], total)
    runs = shard_runs(bounds, 1, sharding, topo.sp_rank)
    scan = SCAN if state_passing else _no_initial_state(SCAN)
    xl, dtl, Bl, Cl = seq
    Al, Dl, biasl = params
    out = sp_mamba2_chunk_scan(
        lambda *a, **kw: scan(*a, chunk_size=chunk, **kw),
        xl,
        dtl,
        Al,
        Bl,
        Cl,
        runs,
        topo.sp_group,
        D=Dl,
        dt_bias=biasl,
        dt_softplus=True,
        dt_limit=dt_limit,
    )
    (out * weight[:, index]).sum().backward()
    for t in params:  # parameter gradients are partial per rank: summed like SP's gradient reduction
        dist.all_reduce(t.grad)
    result = {"out": _rel(out.detach(), ref.detach()[:, index])}
    grads = [xl.grad, dtl.grad, Al.grad, Bl.grad, Cl.grad, Dl.grad, biasl.grad]
    for name, got, want in zip(MAMBA2_NAMES, grads, ref_grads, strict=True):
        result[name] = _rel(got, want if name in ("A", "D", "dt_bias") else want[:, index])
    return _max_over_ranks(result)


def _no_initial_state(scan):
    def without(*args, initial_states=None, **kwargs):  # negative control: every run starts from zero
        if initial_states is not None:
            initial_states = torch.zeros_like(initial_states)
        return scan(*args, initial_states=initial_states, **kwargs)

    return without


def _max_over_ranks(result: dict[str, float]) -> dict[str, float]:
    values = torch.tensor(list(result.values()), dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(result, values.tolist(), strict=True))
