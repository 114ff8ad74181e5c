"""One Gated DeltaNet layer's mixer under SP, two ways, for ``bench_hybrid.py``; their communication in bytes.

- ``ours``: ``sp_causal_conv1d`` + ``sp_chunk_gated_delta_rule`` on the rank's shard (all heads, ``L/P`` tokens): one
  all-gather of the conv halo and one of the fp32 state summary per forward, an all-reduce of each gradient back;
- ``headwise``: what ms-swift and LLaMA-Factory do, written here: all-to-all the pre-conv ``qkv`` and ``[beta | g]``
  from ``[L/P tokens, all heads]`` to ``[L tokens, heads/P]``, transformers' own conv and chunked delta rule on each
  document of the full sequence for those heads, and the output all-to-all back (and the same in the backward).

Inputs of both: ``qkv [b, n, C]`` (pre-conv, ``C = 2 Hk K + Hv V`` channels ``[q | k | v]``), ``beta``, ``g``
``[b, n, Hv]``, a conv weight ``[C, W]`` (no bias, SiLU, as Qwen3.5); output ``[b, n, Hv, V]``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from hf_sp_trainer.comm import gather
from hf_sp_trainer.comm.all_to_all import all_to_all
from hf_sp_trainer.mixers.causal_conv import sp_causal_conv1d
from hf_sp_trainer.mixers.gated_deltanet import sp_chunk_gated_delta_rule
from hf_sp_trainer.mixers.runs import ShardRuns

CONV = getattr(qwen3_5.causal_conv1d_fn, "_hf_sp_original", qwen3_5.causal_conv1d_fn)
GDN = getattr(qwen3_5.torch_chunk_gated_delta_rule, "_hf_sp_original", qwen3_5.torch_chunk_gated_delta_rule)


@dataclass(frozen=True)
class GDNShape:
    v_heads: int
    k_heads: int
    k_dim: int
    v_dim: int
    width: int = 4

    @property
    def channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


QWEN35 = GDNShape(32, 16, 128, 128)  # Qwen3.5 / Qwen3-Next GDN layers


# -- bytes: sent + received per rank, per layer, per forward + backward -------------------------------------------
def ours_bytes(m: GDNShape, sp: int, rows: int = 1, max_runs: int = 1, act: int = 4) -> dict[str, int]:
    """Summary gather ``[max_runs, b, Hv, K, V + K]`` fp32 and halo gather ``[max_runs, b, C, W - 1]`` (``act`` bytes):
    an all-gather sends and receives ``(P - 1) x`` its input, the backward's reduce-scatter of the ``[P, ...]``
    gradient ``(P - 1) / P x`` it each way: ``4 (P - 1) x`` the payload in all."""
    summary = max_runs * rows * m.v_heads * m.k_dim * (m.v_dim + m.k_dim) * 4
    halo = max_runs * rows * m.channels * (m.width - 1) * act
    return {"summary": 4 * (sp - 1) * summary, "halo": 4 * (sp - 1) * halo}


def headwise_bytes(m: GDNShape, sp: int, length: int, rows: int = 1, act: int = 4, z: bool = False) -> dict[str, int]:
    """All-to-alls of ``qkv`` (``C``), ``beta`` (``act`` bytes), ``g`` (fp32, as the model computes it) and the
    output (``Hv V``), ``z`` (``Hv V``) too if the gate is applied after the output comes back: each sends and
    receives ``(P - 1) / P`` of the local tensor, forward and backward."""
    local = rows * length // sp

    def a2a(channels: int, elem: int) -> int:
        return 2 * 2 * (sp - 1) * local * channels * elem // sp  # (sent + received) x (forward + backward)

    out = {"qkv": a2a(m.channels, act), "beta_g": a2a(m.v_heads, act) + a2a(m.v_heads, 4)}
    out["out"] = a2a(m.v_heads * m.v_dim, act) + (a2a(m.v_heads * m.v_dim, act) if z else 0)
    return out


class CommLog:
    """Bytes sent + received by this rank in the collectives the two implementations call, from the tensors handed
    to them: all-gather ``2 (P - 1) x`` the input, all-reduce ``4 (P - 1) / P x`` the tensor, reduce-scatter and
    all-to-all ``2 (P - 1) / P x`` the input; ``calls`` by collective."""

    def __init__(self):
        self.bytes, self.calls = collections.Counter(), collections.Counter()
        self._saved = None

    def __enter__(self):
        world = dist.get_world_size()
        gather_into, all_reduce, a2a = gather._gather_into, dist.all_reduce, dist.all_to_all_single
        reduce_scatter = gather._reduce_scatter

        def counted_scatter(out, x, group=None, **kw):
            self.bytes["reduce_scatter"] += 2 * (world - 1) * x.nbytes // world
            self.calls["reduce_scatter"] += 1
            return reduce_scatter(out, x, group=group, **kw)

        def counted_gather(out, x, group=None, **kw):
            self.bytes["all_gather"] += 2 * (world - 1) * x.nbytes
            self.calls["all_gather"] += 1
            return gather_into(out, x, group=group, **kw)

        def counted_reduce(x, *args, **kw):
            self.bytes["all_reduce"] += 4 * (world - 1) * x.nbytes // world
            self.calls["all_reduce"] += 1
            return all_reduce(x, *args, **kw)

        def counted_a2a(out, x, *args, **kw):
            self.bytes["all_to_all"] += 2 * (world - 1) * x.nbytes // world
            self.calls["all_to_all"] += 1
            return a2a(out, x, *args, **kw)

        self._saved = (gather_into, all_reduce, a2a, reduce_scatter)
        gather._gather_into, dist.all_reduce, dist.all_to_all_single = counted_gather, counted_reduce, counted_a2a
        gather._reduce_scatter = counted_scatter
        return self

    def __exit__(self, *exc):
        gather._gather_into, dist.all_reduce, dist.all_to_all_single, gather._reduce_scatter = self._saved

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


# -- the two implementations --------------------------------------------------------------------------------------
def split_qkv(x: torch.Tensor, m: GDNShape, k_heads: int, v_heads: int):
    """``[b, L, C']`` -> q, k ``[b, L, k_heads, K]``, v ``[b, L, v_heads, V]``."""
    kd, vd = k_heads * m.k_dim, v_heads * m.v_dim
    q, k, v = torch.split(x, [kd, kd, vd], dim=-1)
    b, length = x.shape[:2]
    return (
        q.reshape(b, length, k_heads, m.k_dim),
        k.reshape(b, length, k_heads, m.k_dim),
        v.reshape(b, length, v_heads, m.v_dim),
    )


def ours(qkv, beta, g, weight, m: GDNShape, runs: ShardRuns, group, chunk: int = 64) -> torch.Tensor:
    conv = sp_causal_conv1d(qkv.transpose(1, 2), weight, None, "silu", runs, group).transpose(1, 2)
    q, k, v = split_qkv(conv, m, m.k_heads, m.v_heads)

    def core(*args, **kw):
        return GDN(*args, chunk_size=chunk, **kw)

    out, _ = sp_chunk_gated_delta_rule(core, q, k, v, g, beta, runs, group, use_qk_l2norm_in_kernel=True)
    return out


def _head_channels(m: GDNShape, sp: int) -> torch.Tensor:
    """Channel indices of ``qkv`` in the order of the all-to-all: rank 0's q, k, v heads, then rank 1's, ..."""
    kd, vd = m.k_heads * m.k_dim, m.v_heads * m.v_dim
    q = torch.arange(kd).view(sp, -1)
    v = torch.arange(vd).view(sp, -1) + 2 * kd
    return torch.cat([q, q + kd, v], dim=1).flatten()


def headwise(qkv, beta, g, weight, m: GDNShape, docs: list[tuple[int, int]], group, chunk: int = 64) -> torch.Tensor:
    """``docs``: the ``(start, end)`` documents of the full row (every row alike)."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    if m.k_heads % sp or m.v_heads % sp:
        raise ValueError(f"head-wise SP needs heads divisible by sp={sp} (Hk={m.k_heads}, Hv={m.v_heads})")
    b, n, _ = qkv.shape
    order = _head_channels(m, sp).to(qkv.device)
    x = all_to_all(qkv[..., order].reshape(b, n, sp, -1), 2, 1, group).flatten(2)  # [b, L, C/P]
    gates = torch.stack([beta, g.to(beta.dtype)], -1).reshape(b, n, sp, -1)
    gates = all_to_all(gates, 2, 1, group).reshape(b, n * sp, -1, 2)  # [b, L, Hv/P, 2]
    w = weight[order.view(sp, -1)[rank]]
    hk, hv = m.k_heads // sp, m.v_heads // sp
    outs = []
    for s, e in docs:
        conv = CONV(x[:, s:e].transpose(1, 2), w, None, activation="silu").transpose(1, 2)
        q, k, v = split_qkv(conv, m, hk, hv)
        out, _ = GDN(q, k, v, gates[:, s:e, :, 1], gates[:, s:e, :, 0], chunk_size=chunk, use_qk_l2norm_in_kernel=True)
        outs.append(out)
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]  # [b, L, Hv/P, V]
    return all_to_all(out.contiguous(), 1, 2, group)  # [b, n, Hv, V]
