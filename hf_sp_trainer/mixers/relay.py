"""Relay state passing, a debugging aid: each run starts from the state its predecessor hands over, rank to rank.

The default (``linear_state``) gathers every run's affine summary at once and corrects each rank's first segment.
``sp_state_passing="relay"`` instead computes the runs one after another in global order: a rank receives the
state the run before its own ended in, runs its first segment from it with the model's kernel (as one device does
when it reaches that token), and sends the state its run ends in to the owner of the next run. With runs aligned to
the kernel's chunks this is the single-device computation, operation for operation; it costs one hop per run, in
sequence, so the SP ranks wait on each other (not for training). The backward runs the same chain in reverse: a
received state's gradient goes back to its sender. Each rank's relay operations are chained through a scalar
``token`` so that its autograd engine runs their backwards in the reverse of their forward order (no cross-rank
wait cycle with two zigzag runs per rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .runs import Run, ShardRuns


class _Receive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token: torch.Tensor, shape: tuple[int, ...], src: int, group: dist.ProcessGroup):
        ctx.src, ctx.group = src, group
        state = torch.empty(shape, dtype=torch.float32, device=token.device)
        dist.recv(state, src=dist.get_global_rank(group, src), group=group)
        return state, token.detach().clone()

    @staticmethod
    def backward(ctx, grad_state: torch.Tensor, grad_token: torch.Tensor):
        dist.send(grad_state.contiguous(), dst=dist.get_global_rank(ctx.group, ctx.src), group=ctx.group)
        return grad_token, None, None, None


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: torch.Tensor, token: torch.Tensor, dst: int, group: dist.ProcessGroup):
        ctx.dst, ctx.group, ctx.shape = dst, group, state.shape
        dist.send(state.detach().float().contiguous(), dst=dist.get_global_rank(group, dst), group=group)
        return token.detach().clone()

    @staticmethod
    def backward(ctx, grad_token: torch.Tensor):
        grad_state = torch.empty(ctx.shape, dtype=torch.float32, device=grad_token.device)
        dist.recv(grad_state, src=dist.get_global_rank(ctx.group, ctx.dst), group=ctx.group)
        return grad_state, grad_token, None, None


RunStep = Callable[[Run, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
SegmentScan = Callable[[int, slice, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def segment_step(runs: ShardRuns, rows: int, scan: SegmentScan) -> RunStep:
    """The ``step`` of ``relay_runs`` for a mixer whose ``scan(row, shard slice, S_in or None) -> (output
    [1, n, ...], final state [1, ...])`` runs one document segment of one row: each row of the run cut at its
    document starts, the first segment started from the received state when it continues a document."""

    def step(run: Run, state_in: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        outputs, finals = [], []
        for row in range(rows):
            slices, continues = runs.segments(row, run)
            pieces = []
            for n, sl in enumerate(slices):
                carried = n == 0 and continues and state_in is not None
                out, final = scan(row, sl, state_in[row : row + 1] if carried else None)
                pieces.append(out)
            outputs.append(torch.cat(pieces, dim=1))
            finals.append(final.float())
        return torch.cat(outputs, dim=0), torch.cat(finals, dim=0)

    return step


def relay_runs(
    step: RunStep, runs: ShardRuns, state_shape: tuple[int, ...], anchor: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``step(run, S_in) -> (output, S_out)`` for each of this rank's runs in global order, ``S_in`` (fp32,
    ``state_shape``, or ``None`` for the sequence's first run) being the state the run before it ended in, received
    from its owner (or kept, when this rank owns it too). Returns the runs' outputs and a zero-valued scalar ``token``
    that the layer's output must depend on (``linear_state.touch``), so that every relay's backward runs.
    ``anchor``: a scalar depending on the differentiable inputs (the chain's first link)."""
    token = anchor.float().reshape(()) * 0
    outputs, kept = [], {}
    order = list(runs.runs)
    for run in runs.mine:
        at = order.index(run)
        before = order[at - 1] if at > 0 else None
        after = order[at + 1] if at + 1 < len(order) else None
        if before is None:
            state_in = None
        elif before.rank == runs.rank:
            state_in = kept.pop(run.start)
        else:
            state_in, token = _Receive.apply(token, state_shape, before.rank, group)
        out, state_out = step(run, state_in)
        outputs.append(out)
        if after is not None and after.rank == runs.rank:
            kept[run.end] = state_out
        elif after is not None:
            token = _Send.apply(state_out, token, after.rank, group)
    return outputs, token
