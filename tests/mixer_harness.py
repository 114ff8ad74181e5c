"""Kernel-level exactness of the hybrid mixers under SP: random inputs of a packed batch, each SP rank runs its
shard through the SP kernel, against transformers' own kernel run on each document alone (one process)."""

from __future__ import annotations

import datetime
import functools
import itertools

import torch
import torch.distributed as dist
from transformers.models.bamba import modeling_bamba as bamba
from transformers.models.jamba import modeling_jamba as jamba
from transformers.models.kimi_linear import modeling_kimi_linear as kimi_linear
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5
from transformers.models.recurrent_gemma import modeling_recurrent_gemma as recurrent_gemma

from hf_sp_trainer.documents import document_bounds
from hf_sp_trainer.mixers.causal_conv import sp_causal_conv1d
from hf_sp_trainer.mixers.gated_deltanet import sp_chunk_gated_delta_rule
from hf_sp_trainer.mixers.lightning import lightning_forward
from hf_sp_trainer.mixers.mamba2 import sp_mamba2_chunk_scan
from hf_sp_trainer.mixers.rg_lru import recurrent_block_forward, sp_rnn_scan
from hf_sp_trainer.mixers.runs import shard_runs
from hf_sp_trainer.mixers.selective_scan import sp_selective_scan
from hf_sp_trainer.mixers.varlen_checks import seq_idx_capable, varlen_capable
from hf_sp_trainer.model import hub_functions
from hf_sp_trainer.sharding import SequenceSharding
from hf_sp_trainer.topology import release_groups, sp_topology

CONV = getattr(qwen3_5.causal_conv1d_fn, "_hf_sp_original", qwen3_5.causal_conv1d_fn)
GDN = getattr(qwen3_5.torch_chunk_gated_delta_rule, "_hf_sp_original", qwen3_5.torch_chunk_gated_delta_rule)
KDA = getattr(kimi_linear.chunk_kimi_delta_attention, "_hf_sp_original", kimi_linear.chunk_kimi_delta_attention)
SCAN = getattr(bamba.mamba2_chunk_scan, "_hf_sp_original", bamba.mamba2_chunk_scan)
SELECTIVE = getattr(jamba.mamba_selective_scan, "_hf_sp_original", jamba.mamba_selective_scan)


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
    relay: bool = False,
    varlen: bool = False,
) -> dict[str, float]:
    """Max relative difference (over ranks) of the output and of every input's gradient, SP vs document by
    document, for the gated delta rule (grouped value heads, weak decay unless ``decay`` says otherwise); ``kda``:
    Kimi's delta attention instead (a decay per key channel, one head count, one head size); ``relay``: the state
    handed rank to rank (``sp_state_passing="relay"``) instead of gathered; ``varlen``: lists of segments in one
    kernel call each (the installed kernel where it takes ``cu_seqlens``, else ``segmentwise_varlen`` of it), with
    the most kernel calls of a rank's forward as ``kernel_calls``."""
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
    calls = []
    sp_core = core if not varlen or varlen_capable(core, "cpu", channel_decay=kda) else segmentwise_varlen(core)

    def counted(*a, **kw):
        calls.append(kw.get("cu_seqlens") is not None)
        return sp_core(*a, chunk_size=chunk, **kw)

    out, _ = sp_chunk_gated_delta_rule(
        counted, *local, runs, topo.sp_group, carry_state=carry_state, relay=relay, varlen=varlen,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    forward_calls = len(calls)
    (out * probe[:, index]).sum().backward()
    result = {"out": _rel(out.detach(), ref.detach()[:, index])}
    for name, t, full in zip(("q", "k", "v", "g", "beta"), local, inputs, strict=True):
        result[name] = _rel(t.grad, full.grad[:, index])
    if varlen:
        assert all(calls), "a varlen forward called the kernel without cu_seqlens"
        result[KERNEL_CALLS] = float(forward_calls)
    return _max_over_ranks(result)


KERNEL_CALLS = "kernel_calls"  # not a difference: the most delta-rule kernel calls in one rank's forward


def segmentwise_varlen(core):
    """``core`` (transformers' torch delta rule, which refuses ``cu_seqlens``) as a kernel that takes them: each
    sequence of the one row ``cu_seqlens`` cuts, from its own initial state, through ``core``'s torch path; the
    varlen kernel contract of FLA's, for the CPU tier without FLA."""
    torch_path = hub_functions.torch_path(core)

    def varlen(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **kw):
        kw.pop("cu_seqlens_cpu", None)
        if cu_seqlens is None:
            return torch_path(
                q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state, **kw
            )
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)):
            state = None if initial_state is None else initial_state[i : i + 1]
            out, final = torch_path(
                q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=state,
                output_final_state=output_final_state, **kw,
            )  # fmt: skip
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, 1), torch.cat(finals) if output_final_state else None

    return varlen


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
    relay: bool = False,
    varlen: bool = False,
) -> dict[str, float]:
    """Max relative difference of the scan's output and of every input's gradient, SP vs document by document
    (transformers' ``mamba2_chunk_scan``, softplus on, ``dt_limit`` as given; ``relay``: the state handed rank to
    rank; ``varlen``: each run in one call with ``seq_idx`` (the installed scan where it takes them, else
    ``segmentwise_seq_idx`` of it), the most calls of a rank's forward as ``kernel_calls``)."""
    topo = sp_topology(dist.get_world_size(), ring_size)
    sharding = SequenceSharding(topo.sp_size, ring_size)
    total = sum(docs)
    inputs = mamba2_inputs(total)
    x, dt, A, B, C, D, dt_bias = inputs
    opts = dict(chunk_size=chunk, dt_softplus=True, dt_limit=dt_limit)
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    ref = torch.cat(
        [SCAN(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], D=D, dt_bias=dt_bias, **opts) for s, e in segments(docs)],
        1,
    )
    (ref * weight).sum().backward()
    ref_grads = [t.grad.clone() for t in inputs]
    index = sharding.positions(total, topo.sp_rank)
    seq = [t.detach()[:, index].clone().requires_grad_() for t in (x, dt, B, C)]
    params = [t.detach().clone().requires_grad_() for t in (A, D, dt_bias)]
    bounds = document_bounds([segments(docs)], total)
    runs = shard_runs(bounds, 1, sharding, topo.sp_rank)
    scan = SCAN if state_passing else _no_initial_state(SCAN)
    if varlen and not seq_idx_capable(SCAN, "cpu"):
        scan = segmentwise_seq_idx(SCAN)
    xl, dtl, Bl, Cl = seq
    Al, Dl, biasl = params
    calls = []

    def counted(*a, **kw):
        calls.append(kw.get("seq_idx") is not None)
        return scan(*a, chunk_size=chunk, **kw)

    out = sp_mamba2_chunk_scan(
        counted,
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
        relay=relay,
        varlen=varlen,
    )
    forward_calls = len(calls)
    (out * weight[:, index]).sum().backward()
    for t in params:  # parameter gradients are partial per rank: summed like SP's gradient reduction
        dist.all_reduce(t.grad)
    result = {"out": _rel(out.detach(), ref.detach()[:, index])}
    grads = [xl.grad, dtl.grad, Al.grad, Bl.grad, Cl.grad, Dl.grad, biasl.grad]
    for name, got, want in zip(MAMBA2_NAMES, grads, ref_grads, strict=True):
        result[name] = _rel(got, want if name in ("A", "D", "dt_bias") else want[:, index])
    if varlen:
        result[KERNEL_CALLS] = float(forward_calls)
    return _max_over_ranks(result)


def segmentwise_seq_idx(scan):
    """transformers' torch Mamba2 scan (which refuses ``seq_idx``) as one that takes it: each stretch of one
    ``seq_idx`` value from a zero state, the final state the last stretch's; mamba_ssm's contract, for the CPU tier."""
    torch_path = hub_functions.torch_path(scan)

    def packed(x, dt, A, B, C, seq_idx=None, initial_states=None, return_final_states=False, **kw):
        if seq_idx is None:
            return torch_path(
                x, dt, A, B, C, initial_states=initial_states, return_final_states=return_final_states, **kw
            )
        cuts = [0, *(seq_idx[0, 1:] != seq_idx[0, :-1]).nonzero().flatten().add(1).tolist(), x.shape[1]]
        outs, final = [], None
        for a, b in itertools.pairwise(cuts):
            out, final = torch_path(
                x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], initial_states=None, return_final_states=True, **kw
            )
            outs.append(out)
        out = torch.cat(outs, 1)
        return (out, final) if return_final_states else out

    return packed


SELECTIVE_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def check_selective(
    docs: list[int], ring_size: int, channels: int = 6, state: int = 4, carry_state: bool = True, relay: bool = False
) -> dict[str, float]:
    """Max relative difference of Mamba1's selective scan output and of every input's gradient, SP vs document by
    document (transformers' ``mamba_selective_scan``: gate ``z``, ``D``, ``delta_bias``, softplus; weak decay)."""
    topo = sp_topology(dist.get_world_size(), ring_size)
    sharding = SequenceSharding(topo.sp_size, ring_size)
    total = sum(docs)
    gen = torch.Generator().manual_seed(0)
    u, delta, z = (torch.randn(1, channels, total, generator=gen) for _ in range(3))
    A = -0.1 - 0.4 * torch.rand(channels, state, generator=gen)
    B, C = (torch.randn(1, state, total, generator=gen) for _ in range(2))
    D, delta_bias = torch.randn(channels, generator=gen), -2.0 + 0.1 * torch.randn(channels, generator=gen)
    inputs = [t.requires_grad_() for t in (u, delta, A, B, C, D, z, delta_bias)]
    opts = dict(delta_softplus=True)
    weight = torch.randn(u.shape, generator=torch.Generator().manual_seed(1))
    ref = torch.cat(
        [
            SELECTIVE(u[..., s:e], delta[..., s:e], A, B[..., s:e], C[..., s:e], D=D, z=z[..., s:e],
                      delta_bias=delta_bias, **opts)
            for s, e in segments(docs)
        ],
        -1,
    )  # fmt: skip
    (ref * weight).sum().backward()
    ref_grads = [t.grad.clone() for t in inputs]
    index = sharding.positions(total, topo.sp_rank)
    ul, dl, Bl, Cl, zl = (t.detach()[..., index].clone().requires_grad_() for t in (u, delta, B, C, z))
    Al, Dl, biasl = (t.detach().clone().requires_grad_() for t in (A, D, delta_bias))
    runs = shard_runs(document_bounds([segments(docs)], total), 1, sharding, topo.sp_rank)
    out = sp_selective_scan(
        SELECTIVE, ul, dl, Al, Bl, Cl, runs, topo.sp_group, D=Dl, z=zl, delta_bias=biasl, delta_softplus=True,
        relay=relay, carry_state=carry_state,
    )  # fmt: skip
    (out * weight[..., index]).sum().backward()
    for t in (Al, Dl, biasl):  # parameter gradients are partial per rank: summed like SP's gradient reduction
        dist.all_reduce(t.grad)
    result = {"out": _rel(out.detach(), ref.detach()[..., index])}
    grads = [ul.grad, dl.grad, Al.grad, Bl.grad, Cl.grad, Dl.grad, zl.grad, biasl.grad]
    for name, got, want in zip(SELECTIVE_NAMES, grads, ref_grads, strict=True):
        result[name] = _rel(got, want if name in ("A", "D", "delta_bias") else want[..., index])
    return _max_over_ranks(result)


def lightning_layer(block: int = 4, decay: float = 0.02, seed: int = 0):
    """A tiny ``MiniMaxLightningAttention`` (2 heads of 8, ``block``-token blocks) with its slopes set to ``decay``
    per token (weak: the state reaches across documents and ranks), and the modeling module."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax import modeling_minimax as minimax

    config = MiniMaxConfig(
        hidden_size=16, num_attention_heads=2, head_dim=8, num_hidden_layers=2, block_size=block,
        layer_types=["linear_attention", "full_attention"], intermediate_size=16, vocab_size=8,
    )  # fmt: skip
    torch.manual_seed(seed)
    layer = minimax.MiniMaxLightningAttention(config, 0)
    slope = torch.tensor([decay, decay / 4]).view(2, 1, 1)
    names = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
    for name, value in zip(names, (slope, *layer.decay_factors(slope)), strict=True):
        setattr(layer, name, value)
    return layer, minimax


def check_lightning(
    rows: list[list[int]], ring_size: int = 1, *, block: int = 4, carry_state: bool = True, relay: bool = False
) -> dict[str, float]:
    """MiniMax's lightning attention layer: its output, the input's gradient and every weight's gradient (summed
    over the SP ranks), SP (``lightning_forward``) vs the installed forward on each document alone."""
    topo, index, runs, total = _setup(rows, ring_size)
    layer, minimax = lightning_layer(block)
    forward = getattr(type(layer).forward, "_hf_sp_original", type(layer).forward)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(rows), total, 16, generator=gen).requires_grad_()
    probe = torch.randn(x.shape, generator=gen)
    ref = _per_document(lambda t: forward(layer, t, None, None)[0], rows, 1, x)
    (ref * probe).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    xl = x.detach()[:, index].clone().requires_grad_()
    padding = minimax.apply_mask_to_padding_states
    out, _ = lightning_forward(layer, xl, None, runs, topo.sp_group, padding, relay=relay, carry_state=carry_state)
    (out * probe[:, index]).sum().backward()
    result = {"out": _rel(out.detach(), ref.detach()[:, index]), "x": _rel(xl.grad, x.grad[:, index])}
    return _with_weight_grads(result, layer, ref_grads, topo.sp_group)


def recurrent_block(seed: int = 0):
    """A tiny RecurrentGemma recurrent block (width 16, 2 heads, conv width 4), its RG-LRU's decay weak (``a`` in
    0.86-1 per token: the state reaches across documents and ranks)."""
    config = recurrent_gemma.RecurrentGemmaConfig(
        hidden_size=16, lru_width=16, num_attention_heads=2, conv1d_width=4, vocab_size=8
    )
    torch.manual_seed(seed)
    block = recurrent_gemma.RecurrentGemmaRecurrentBlock(config, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        block.rg_lru.recurrent_param.fill_(-4.0)
    return block


def check_rg_lru(
    rows: list[list[int]], ring_size: int = 1, *, carry_state: bool = True, relay: bool = False
) -> dict[str, float]:
    """RecurrentGemma's recurrent block (conv + RG-LRU): output, input gradient and every weight's gradient (summed
    over the SP ranks), SP (``recurrent_block_forward``, the scan carried by ``sp_rnn_scan``) vs the installed
    forward on each document alone."""
    topo, index, runs, total = _setup(rows, ring_size)
    block = recurrent_block()
    cls = type(block)
    forward = getattr(cls.forward, "_hf_sp_original", cls.forward)
    scan = getattr(type(block.rg_lru)._rnn_scan, "_hf_sp_original", type(block.rg_lru)._rnn_scan)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(rows), total, 16, generator=gen).requires_grad_()
    probe = torch.randn(x.shape, generator=gen)
    positions = torch.stack([torch.cat([torch.arange(e - s) for s, e in segments(docs)]) for docs in rows])
    ref = _per_document(
        lambda t, p: forward(block, t, position_ids=p, attention_mask=None, use_cache=False)[0], rows, 1, x, positions
    )
    (ref * probe).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()

    def carried(hidden_states, recurrent_gate, reset, recurrent_states):  # this block's scan only (an attribute)
        own = functools.partial(scan, block.rg_lru)
        args = (hidden_states, recurrent_gate, reset, runs, topo.sp_group)
        return sp_rnn_scan(own, *args, relay=relay, carry_state=carry_state), None

    block.rg_lru._rnn_scan = carried
    xl = x.detach()[:, index].clone().requires_grad_()
    out, _ = recurrent_block_forward(block, xl, positions[:, index], runs, topo.sp_group, {})
    (out * probe[:, index]).sum().backward()
    result = {"out": _rel(out.detach(), ref.detach()[:, index]), "x": _rel(xl.grad, x.grad[:, index])}
    return _with_weight_grads(result, block, ref_grads, topo.sp_group)


def _no_initial_state(scan):
    def without(*args, initial_states=None, **kwargs):  # negative control: every run starts from zero
        if initial_states is not None:
            initial_states = torch.zeros_like(initial_states)
        return scan(*args, initial_states=initial_states, **kwargs)

    return without


def _with_weight_grads(result: dict[str, float], module, ref_grads: dict, group) -> dict[str, float]:
    """``result`` and every weight's gradient difference (summed over the SP ranks first), worst over the ranks."""
    for name, p in module.named_parameters():
        dist.all_reduce(p.grad, group=group)
        result[name] = _rel(p.grad, ref_grads[name])
    return _max_over_ranks(result)


def _max_over_ranks(result: dict[str, float]) -> dict[str, float]:
    values = torch.tensor(list(result.values()), dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    release_groups()
    return dict(zip(result, values.tolist(), strict=True))


def run_checks(cases: list[tuple[str, str, dict]]) -> dict[str, dict[str, float]]:
    """In a spawned group: ``(name, kind of ``checks``, kwargs)`` cases in turn -> each
    case's differences."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    checks = {"gdn": check_gdn, "conv": check_conv, "mamba2": check_mamba2, "lightning": check_lightning}
    checks |= {"selective": check_selective, "rg_lru": check_rg_lru}
    return {name: checks[kind](**kwargs) for name, kind, kwargs in cases}
