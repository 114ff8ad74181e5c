"""Exact ring attention over a zigzag-split sequence, with packed documents, sliding windows, soft-capping and GQA.

Ring rank ``i`` of ``R`` holds its zigzag portion (``zigzag.zigzag_ranges``) of q, k, v. Forward, ``R`` steps: at
step ``t`` it holds the K/V of ring rank ``(i - t) mod R``; it posts the shift of that K/V block to the next rank,
computes the visible sub-blocks of its queries against it (``zigzag.plan_ring``), merges them into the running
output with the log-sum-exp, and waits for the next block. Backward, ``R`` steps again: K/V travel as in the forward
and the dK/dV accumulators of each block travel with them, so every block's gradient is back with its owner after
the last shift. Each rank keeps only its own q, k, v, output and LSE: memory O(S / R) per rank.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group

from ..comm.ring_shift import GRAD_TAG, KV_TAG, ring_shift
from ..sharding.zigzag import BlockTask, RingPlan, plan_ring
from .block_attention import acc_dtype, block_backward, block_forward, check_kernel


def _ring(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def document_bounds(segments: list[list[tuple[int, int]]], seq_len: int) -> torch.Tensor:
    """The documents of every row as one int64 tensor of boundaries, rows laid end to end (``[0, ..., b * S]``)."""
    starts = [r * seq_len + start for r, row in enumerate(segments) for start, _ in row]
    return torch.tensor([*starts, len(segments) * seq_len], dtype=torch.int64)


def _segments(bounds: list[int], rows: int) -> list[list[tuple[int, int]]]:
    seq_len = bounds[-1] // rows
    out: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        out[start // seq_len].append((start % seq_len, end - (start // seq_len) * seq_len))
    return out


@functools.lru_cache(maxsize=16)
def _cached_plan(
    bounds: tuple[int, ...], rows: int, ring_size: int, rank: int, window: int | None, images: tuple
) -> RingPlan:
    """One plan per (layout, rank, window, images): planned by the first layer of a forward, reused by the others."""
    seq = bounds[-1] // rows
    return plan_ring(_segments(list(bounds), rows), seq, ring_size, rank, window, images=images)


def merge_block(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-merge a block's ``(out, lse)`` into the running ``(out, lse)`` in place (both in the accumulation
    dtype). Rows without any visible key so far have ``lse = -inf`` and output 0; they stay NaN-free."""
    new = torch.logaddexp(lse, block_lse)
    ref = new.masked_fill(new == float("-inf"), 0.0)  # exp(-inf - 0) = 0 instead of exp(-inf + inf) = nan
    block_weight = torch.exp(block_lse - ref).unsqueeze(-1)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).addcmul_(block_out.to(out.dtype), block_weight)
    lse.copy_(new)
    return out, lse


def _task_args(task: BlockTask, plan: RingPlan, scale: float, softcap: float | None, kernel: str) -> dict:
    return dict(
        kind=task.kind, scale=scale, offset=task.offset, docs=task.docs, window=plan.sliding_window,
        softcap=softcap, kernel=kernel,
    )  # fmt: skip


def _sl(task: BlockTask, which: str) -> tuple[slice, slice, slice]:
    """Index of the task's rows x (all heads) x its query or key range in a ``[b, h, n, ...]`` tensor."""
    lo, hi = task.q if which == "q" else task.k
    return slice(*task.rows), slice(None), slice(lo, hi)


def _group(group_name: str) -> dist.ProcessGroup | None:
    return _resolve_process_group(group_name) if group_name else None


def _plan(bounds, images, q: torch.Tensor, group: dist.ProcessGroup | None, window: int) -> RingPlan:
    rank, size = _ring(group)
    blocks = () if images is None else tuple(map(tuple, images.tolist()))
    return _cached_plan(tuple(bounds.tolist()), q.shape[0], size, rank, window or None, blocks)


def _whole_block(plan: RingPlan, q: torch.Tensor) -> BlockTask | None:
    """The plan's only task when it covers every row and query of a ring of one (Ulysses without a ring)."""
    if plan.ring_size != 1 or len(plan.steps[0]) != 1:
        return None
    task = plan.steps[0][0]
    return task if task.rows == (0, q.shape[0]) and task.q == (0, q.shape[2]) else None


def _split_kv(kv: torch.Tensor, dqk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one ring message ``[b, hkv, n, dqk + dv]`` (views)."""
    return kv[..., :dqk], kv[..., dqk:]


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One more logit per (query, head), ``sinks [hq]``, with a zero value, in the softmax of the merged ``(out, lse)``
    (accumulation dtype): ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``."""
    new = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    return out * torch.exp(lse - new).unsqueeze(-1), new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``dsink_h = -sum_q exp(sink_h - lse'_q) * rowsum(dout * out')_q`` over this rank's queries (final out', lse')."""
    dt = lse.dtype
    delta = (dout.to(dt) * out.to(dt)).sum(-1)
    return -(torch.exp(sinks.to(dt)[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)


@torch.library.custom_op("hf_sp_trainer::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    images: torch.Tensor | None,
    sinks: torch.Tensor | None,
    group_name: str,
    scale: float,
    window: int,
    softcap: float,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out [b, hq, n, dv], lse [b, hq, n])`` (the LSE includes the sinks). One dispatcher op, opaque to
    ``torch.compile``; ``window`` and ``softcap`` are 0 when absent, ``group_name`` is empty for a ring of one."""
    group = _group(group_name)
    plan = _plan(bounds, images, q, group, window)
    whole = _whole_block(plan, q)
    dt, dqk = acc_dtype(q.dtype), q.shape[-1]
    if whole is not None:  # a ring of one, one task for all rows and documents: nothing to merge
        out, lse = block_forward(q, k, v, **_task_args(whole, plan, scale, softcap or None, kernel))
        out, lse = out.to(dt), lse.to(dt)
    else:
        out = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=dt, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=dt, device=q.device)
        # one message per step, exactly k's and v's bytes (MLA: dv != dqk); K/V keep their hkv heads (GQA)
        kv = torch.cat([k, v], -1)
        for t in range(plan.ring_size):
            pending = ring_shift(kv, group, KV_TAG) if t + 1 < plan.ring_size else None  # overlap: next in flight
            kb, vb = _split_kv(kv, dqk)
            for task in plan.steps[t]:
                qs, ks = _sl(task, "q"), _sl(task, "k")
                o, s = block_forward(q[qs], kb[ks], vb[ks], **_task_args(task, plan, scale, softcap or None, kernel))
                merge_block(out[qs], lse[qs], o, s)
            if pending is not None:
                kv = pending.wait()
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out.to(q.dtype).contiguous(), lse.contiguous()  # the fake's layout


@ring_attention_op.register_fake
def _(q, k, v, bounds, images, sinks, group_name, scale, window, softcap, kernel):
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    return out, q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))  # contiguous, as the real op


@torch.library.custom_op("hf_sp_trainer::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bounds: torch.Tensor,
    images: torch.Tensor | None,
    sinks: torch.Tensor | None,
    group_name: str,
    scale: float,
    window: int,
    softcap: float,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: K/V travel the ring again, with the dK/dV accumulators of each block, which end with their owner.
    Given the final ``(out, lse)`` (sinks included) the block backward is exact; the 4th output is dsinks (empty
    without sinks)."""
    group = _group(group_name)
    plan = _plan(bounds, images, q, group, window)
    whole = _whole_block(plan, q)
    dout = dout.to(q.dtype)
    dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None else q.new_zeros(0)
    if whole is not None:
        args = _task_args(whole, plan, scale, softcap or None, kernel)
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, **args)
        return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dsinks
    size, dt, dqk = plan.ring_size, acc_dtype(q.dtype), q.shape[-1]
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    kv, grads_in = torch.cat([k, v], -1), None
    for t in range(size):
        pending = ring_shift(kv, group, KV_TAG) if t + 1 < size else None
        dkv = torch.zeros(kv.shape, dtype=dt, device=q.device)  # this step's dK/dV of the held block
        (kb, vb), (dkb, dvb) = _split_kv(kv, dqk), _split_kv(dkv, dqk)
        for task in plan.steps[t]:
            qs, ks = _sl(task, "q"), _sl(task, "k")
            args = _task_args(task, plan, scale, softcap or None, kernel)
            gq, gk, gv = block_backward(dout[qs], q[qs], kb[ks], vb[ks], out[qs], lse[qs], **args)
            dq[qs] += gq
            dkb[ks] += gk
            dvb[ks] += gv
        if grads_in is not None:
            dkv += grads_in.wait()  # what the previous ranks accumulated for the same block
        if size > 1:  # after the last step this shift brings every block's gradient home
            grads_in = ring_shift(dkv, group, GRAD_TAG)
        if pending is not None:
            kv = pending.wait()
    if grads_in is not None:
        dkv = grads_in.wait()
    dk, dv = _split_kv(dkv, dqk)
    return dq.to(q.dtype), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dsinks  # outputs must not alias


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, bounds, images, sinks, group_name, scale, window, softcap, kernel):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bounds, images, sinks, *ctx.args = inputs
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(q, k, v, output[0], output[1], bounds, images, sinks)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, bounds, images, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = ring_attention_backward_op(dout, q, k, v, out, lse, bounds, images, sinks, *ctx.args)
    return dq, dk, dv, None, None, dsinks if ctx.has_sinks else None, None, None, None, None, None


ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def autocast_like_sdpa(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, cast q/k/v to the autocast dtype as autocast does for sdpa (a lower-precision op).

    Autocast cannot see into our custom op, and rotary embeddings leave q/k in fp32 while v is bf16 (the fused CPU
    kernel refuses mixed dtypes). Ulysses casts before its all-to-all: the same cast, half the bytes moved.
    """
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | list[list[tuple[int, int]]],
    group: dist.ProcessGroup | None,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kernel: str = "sdpa",
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
    image_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact causal attention of this ring rank's zigzag portion ``q, k [b, hq | hkv, n, d]``, ``v [b, hkv, n, dv]``
    over the whole sequence of ``n * R`` tokens; returns ``[b, n, hq, dv]`` (transformers' attention-output layout).
    ``sinks [hq]``: one learned logit per head with a zero value in every row's softmax (gpt-oss), or ``None``.
    ``image_blocks [n, 3]``: ``(row, start, end)`` (global) of images whose tokens also see the later tokens of the
    same image and document (Gemma3; ``image_blocks.image_blocks``), or ``None``.

    ``bounds``: the documents of every row in global coordinates, as ``document_bounds`` (a tensor, rows end to end)
    or per-row segments (``DocumentLayout.segments``); ``group``: the ring process group (``None``: a ring of one).
    Query ``p`` sees key ``j`` iff same document and either ``j <= p`` and ``p - j < sliding_window``, or both
    are in one image of ``image_blocks``. Every rank raises the
    same ``ValueError`` before any communication for an unsupported kernel, dropout or shape.
    """
    check_kernel(kernel, q.device, softcap)
    if dropout:
        raise ValueError(f"ring attention does not support attention dropout (got {dropout}); set it to 0.")
    b, hq, n, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[2:] != (n, d) or hq % k.shape[1]:
        raise ValueError(
            f"ring attention got q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)}: k needs q's batch, "
            "length and head dim, v k's batch, heads and length (its head dim may differ), hq a multiple of hkv"
        )
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"ring attention got sinks of shape {tuple(sinks.shape)} for {hq} query heads; need ({hq},)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
    _, size = _ring(group)
    if not torch.is_tensor(bounds):
        if len(bounds) != b:
            raise ValueError(f"segments describe {len(bounds)} rows for a batch of {b}")
        bounds = document_bounds(bounds, n * size)
    group_name = group.group_name if group is not None and size > 1 else ""
    q, k, v = autocast_like_sdpa(q, k, v)
    window, cap = sliding_window or 0, softcap or 0.0
    images = None if image_blocks is None or not image_blocks.numel() else image_blocks.cpu()
    out, _ = ring_attention_op(q, k, v, bounds, images, sinks, group_name, scale, window, cap, kernel)
    return out.transpose(1, 2)
