"""Exact ring attention over a zigzag-split sequence, with packed documents, sliding windows, soft-capping and GQA.

Ring rank ``i`` of ``R`` holds its zigzag portion (``zigzag.zigzag_ranges``) of q, k, v. Forward, ``R`` steps: at
step ``t`` it holds the K/V of ring rank ``(i - t) mod R``; it posts the shift of that K/V block to the next rank,
computes the visible sub-blocks of its queries against it (``zigzag.plan_ring``), merges them into the running
output with the log-sum-exp, and waits for the next block. Backward, ``R`` steps again: K/V travel as in the forward
and the dK/dV accumulators of each block travel with them, so every block's gradient is back with its owner after
the last shift. Each rank keeps only its own q, k, v, output and LSE: memory O(S / R) per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .block_attention import acc_dtype, block_backward, block_forward, check_kernel
from .ring_comm import GRAD_TAG, KV_TAG, ring_shift
from .zigzag import BlockTask, RingPlan, plan_ring


def _ring(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def make_plan(
    segments: list[list[tuple[int, int]]], portion_len: int, group: dist.ProcessGroup | None, window: int | None
) -> RingPlan:
    """The block plan of this ring rank for a portion of ``portion_len`` tokens (reusable by every layer)."""
    rank, size = _ring(group)
    return plan_ring(segments, portion_len * size, size, rank, window)


def merge_block(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-merge a block's ``(out, lse)`` into the running ``(out, lse)`` in place (both in the accumulation
    dtype). Rows without any visible key so far have ``lse = -inf`` and output 0; they stay NaN-free."""
    new = torch.logaddexp(lse, block_lse)
    ref = new.masked_fill(new == float("-inf"), 0.0)  # exp(-inf - 0) = 0 instead of exp(-inf + inf) = nan
    block_weight = torch.exp(block_lse - ref).unsqueeze(-1)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).add_(block_out.to(out.dtype) * block_weight)
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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, group, scale, softcap, kernel):  # type: ignore[override]
        size = plan.ring_size
        out = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=out.dtype, device=q.device)
        kv = torch.stack([k, v])  # one message per step; K/V keep their hkv heads (GQA is not expanded)
        for t in range(size):
            pending = ring_shift(kv, group, KV_TAG) if t + 1 < size else None  # overlap: next block in flight
            for task in plan.steps[t]:
                qs, ks = _sl(task, "q"), _sl(task, "k")
                o, s = block_forward(q[qs], kv[0][ks], kv[1][ks], **_task_args(task, plan, scale, softcap, kernel))
                merge_block(out[qs], lse[qs], o, s)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.group, ctx.scale, ctx.softcap, ctx.kernel = plan, group, scale, softcap, kernel
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan, group = ctx.plan, ctx.group
        size, dt = plan.ring_size, acc_dtype(q.dtype)
        dout = dout.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        kv, grads_in = torch.stack([k, v]), None
        for t in range(size):
            pending = ring_shift(kv, group, KV_TAG) if t + 1 < size else None
            dkv = torch.zeros(kv.shape, dtype=dt, device=q.device)  # this step's dK/dV of the held block
            for task in plan.steps[t]:
                qs, ks = _sl(task, "q"), _sl(task, "k")
                args = _task_args(task, plan, ctx.scale, ctx.softcap, ctx.kernel)
                gq, gk, gv = block_backward(dout[qs], q[qs], kv[0][ks], kv[1][ks], out[qs], lse[qs], **args)
                dq[qs] += gq
                dkv[0][ks] += gk
                dkv[1][ks] += gv
            if grads_in is not None:
                dkv += grads_in.wait()  # what the previous ranks accumulated for the same block
            if size > 1:  # after the last step this shift brings every block's gradient home
                grads_in = ring_shift(dkv, group, GRAD_TAG)
            if pending is not None:
                kv = pending.wait()
        if grads_in is not None:
            dkv = grads_in.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[list[tuple[int, int]]],
    group: dist.ProcessGroup | None,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kernel: str = "sdpa",
    dropout: float = 0.0,
    plan: RingPlan | None = None,
) -> torch.Tensor:
    """Exact causal attention of this ring rank's zigzag portion ``q [b, hq, n, d]``, ``k, v [b, hkv, n, d]`` over
    the whole sequence of ``n * R`` tokens; returns ``[b, n, hq, d]`` (transformers' attention-output layout).

    ``segments``: the documents of each row in global coordinates (``DocumentLayout.segments``); ``group``: the ring
    process group (``None``: a ring of one). Query ``p`` sees key ``j`` iff same document, ``j <= p`` and
    ``p - j < sliding_window``. ``plan``: a precomputed ``make_plan`` result to reuse across layers. Every rank
    raises the same ``ValueError`` before any communication for an unsupported kernel, dropout or shape.
    """
    check_kernel(kernel, q.device, softcap)
    if dropout:
        raise ValueError(f"ring attention does not support attention dropout (got {dropout}); set it to 0.")
    b, hq, n, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (n, d) or hq % k.shape[1]:
        raise ValueError(f"ring attention got q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)}")
    if len(segments) != b:
        raise ValueError(f"segments describe {len(segments)} rows for a batch of {b}")
    rank, size = _ring(group)
    if plan is None:
        plan = make_plan(segments, n, group, sliding_window)
    elif (plan.rank, plan.ring_size, plan.seq_len, plan.sliding_window) != (rank, size, n * size, sliding_window):
        raise ValueError("the precomputed ring plan was made for another rank, ring, length or sliding window")
    out = _RingAttention.apply(q, k, v, plan, group, scale, softcap, kernel)
    return out.transpose(1, 2).contiguous()
