"""Kernel-level exactness of the hybrid mixers under SP: random inputs of a packed batch, each SP rank runs its
shard through the SP kernel, against transformers' own kernel run on each document alone (one process)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from transformers.models.kimi_linear import modeling_kimi_linear as kimi_linear
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from hf_sp_trainer.attention.ring import document_bounds
from hf_sp_trainer.mixers.causal_conv import sp_causal_conv1d
from hf_sp_trainer.mixers.gated_deltanet import sp_chunk_gated_delta_rule
from hf_sp_trainer.mixers.runs import shard_runs
from hf_sp_trainer.sharding import SequenceSharding
from hf_sp_trainer.topology import release_groups, sp_topology

CONV = getattr(qwen3_5.causal_conv1d_fn, "_hf_sp_original", qwen3_5.causal_conv1d_fn)
GDN = getattr(qwen3_5.torch_chunk_gated_delta_rule, "_hf_sp_original", qwen3_5.torch_chunk_gated_delta_rule)
KDA = getattr(kimi_linear.chunk_kimi_delta_attention, "_hf_sp_original", kimi_linear.chunk_kimi_delta_attention)


def segments(docs: list[int]) -> list[tuple[int, int]]:
    edges = [0]
    for d in docs:
        edges.append(edges[-1] + d)
    return list(zip(edges[:-1], edges[1:], strict=True))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _setup(rows: list[list[int]], ring_size: int):
    topo = sp_topology(dist.get_world_size(), ring_size)
    sharding = SequenceSharding(topo.sp_size, ring_size)
    total = sum(rows[0])
    assert all(sum(r) == total for r in rows) and total % sharding.multiple == 0, (rows, sharding.multiple)
    bounds = document_bounds([segments(r) for r in rows], total)
    runs = shard_runs(bounds, len(rows), sharding, topo.sp_rank)
    return topo, sharding.positions(total, topo.sp_rank), runs, total


def _per_document(fn, rows: list[list[int]], dim: int, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on each document of each row alone, concatenated back along ``dim``."""
    out = []
    for r, docs in enumerate(rows):
        parts = [fn(*(t[r : r + 1].narrow(dim, s, e - s) for t in tensors)) for s, e in segments(docs)]
        out.append(torch.cat(parts, dim))
    return torch.cat(out, 0)


def check_gdn(
    rows: list[list[int]],
    ring_size: int = 1,
    *,
    chunk: int = 64,
    decay: float = 0.05,
    heads: int = 4,
    k_heads: int = 2,
    carry_state: bool = True,
    kda: bool = False,
) -> dict[str, float]:
    """Max relative difference (over ranks) of the output and of every input's gradient, SP vs document by
    document, for the gated delta rule (grouped value heads, weak decay unless ``decay`` says otherwise); ``kda``:
    Kimi's delta attention instead (a decay per key channel, one head count, one head size)."""
    topo, index, runs, total = _setup(rows, ring_size)
    gen = torch.Generator().manual_seed(0)
    b = len(rows)
    core = KDA if kda else GDN
    k_heads = heads if kda else k_heads
    q, k = (torch.randn(b, total, k_heads, 8, generator=gen) for _ in range(2))
    v = torch.randn(b, total, heads, 8 if kda else 6, generator=gen)
    g = -decay * torch.rand(b, total, heads, *((8,) if kda else ()), generator=gen)
    beta = torch.rand(b, total, heads, generator=gen)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    probe = torch.randn(v.shape, generator=gen)
    opts = dict(chunk_size=chunk, use_qk_l2norm_in_kernel=True)
    ref = _per_document(lambda *t: core(*t, **opts)[0], rows, 1, *inputs)
    (ref * probe).sum().backward()
    local = [t.detach()[:, index].clone().requires_grad_() for t in inputs]
    out, _ = sp_chunk_gated_delta_rule(
        lambda *a, **kw: core(*a, chunk_size=chunk, **kw), *local, runs, topo.sp_group, carry_state=carry_state,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    (out * probe[:, index]).sum().backward()
    result = {"out": _rel(out.detach(), ref.detach()[:, index])}
    for name, t, full in zip(("q", "k", "v", "g", "beta"), local, inputs, strict=True):
        result[name] = _rel(t.grad, full.grad[:, index])
    return _max_over_ranks(result)


def check_conv(rows: list[list[int]], ring_size: int = 1, *, width: int = 4, halo: bool = True) -> dict[str, float]:
    """The same for the depthwise causal conv (and its weight and bias gradients, summed over the SP ranks)."""
    topo, index, runs, total = _setup(rows, ring_size)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(rows), 5, total, generator=gen).requires_grad_()
    w, bias = torch.randn(5, width, generator=gen).requires_grad_(), torch.randn(5, generator=gen).requires_grad_()
    probe = torch.randn(x.shape, generator=gen)
    ref = _per_document(lambda t: CONV(t, w, bias, activation="silu"), rows, 2, x)
    (ref * probe).sum().backward()
    xl = x.detach()[:, :, index].clone().requires_grad_()
    wl, bl = w.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    out = sp_causal_conv1d(xl, wl, bl, "silu", runs, topo.sp_group, halo=halo)
    (out * probe[:, :, index]).sum().backward()
    for t in (wl, bl):  # parameter gradients are partial per rank: summed, as SP's gradient reduction does
        dist.all_reduce(t.grad, group=topo.sp_group)
    result = {"out": _rel(out.detach(), ref.detach()[:, :, index]), "x": _rel(xl.grad, x.grad[:, :, index])}
    result.update(weight=_rel(wl.grad, w.grad), bias=_rel(bl.grad, bias.grad))
    return _max_over_ranks(result)


def _max_over_ranks(result: dict[str, float]) -> dict[str, float]:
    values = torch.tensor(list(result.values()), dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    release_groups()
    return dict(zip(result, values.tolist(), strict=True))


def run_checks(cases: list[tuple[str, str, dict]]) -> dict[str, dict[str, float]]:
    """In a spawned group: ``(name, "gdn" | "conv", kwargs)`` cases in turn -> each case's differences."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    checks = {"gdn": check_gdn, "conv": check_conv}
    return {name: checks[kind](**kwargs) for name, kind, kwargs in cases}
