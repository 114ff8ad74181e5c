"""Mamba2's SSD scan (Bamba, Nemotron-H, Granite-4.0-H, Falcon-H1, Zamba2, Mamba2) under SP, exact: the model's own
chunked scan over this rank's runs, with the state carried in from the runs before them (``linear_state``).

The scan ``h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T``, ``y_t = C_t h_t + D_h x_t`` (state ``[head_dim, N]`` per
head) is affine in its initial state, with a scalar transition per head: a run from ``h_in`` ends in
``exp(A_h sum_t dt_t) h_in + S_ext``, where ``dt`` is the step size after the kernel's own processing (``+ dt_bias``,
softplus, the ``time_step_limit`` clamp; ``step_sizes`` repeats it, and the swap's check holds the installed kernel
to it). Each document segment inside a run is scanned alone from zero (packed documents never leak into each other);
the segment that continues a document from an earlier rank adds the scan of ``x = 0`` from the incoming state, in
which ``D x`` vanishes: ``y(x, h_in) = y(x, 0) + y(0, h_in)``. ``relay=True`` (``sp_state_passing="relay"``, a
debugging aid) scans the first segment from the state handed over by the rank before instead (``relay``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .linear_state import incoming_states, touch
from .relay import relay_runs, segment_step
from .runs import ShardRuns


def step_sizes(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool, limit: tuple[float, float]
) -> torch.Tensor:
    """The step sizes ``mamba2_chunk_scan`` discretises with: ``dt + dt_bias``, softplus, clamped to ``limit``."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=limit[0], max=limit[1])


def run_decay(A: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``exp(A_h sum_t dt_t)``: the transition of a stretch of step sizes ``steps [L, H]`` (fp32), per head."""
    return torch.exp(A.float() * steps.float().sum(0))


def sp_mamba2_chunk_scan(
    scan: Callable,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    runs: ShardRuns,
    group: dist.ProcessGroup,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    relay: bool = False,
) -> torch.Tensor:
    """The model's chunked ``scan`` on this rank's shard (``x [b, L, H, P]``, ``dt [b, L, H]``, ``B``/``C``
    ``[b, L, G, N]``), each document as if alone; the scan's output ``[b, L, H, P]``. ``relay``: the state handed
    rank to rank (``relay.py``) instead of gathered."""
    b, _, heads, head_dim = x.shape
    state_size = B.shape[-1]
    steps = step_sizes(dt, dt_bias, dt_softplus, dt_limit)
    outputs = [[None] * len(runs.mine) for _ in range(b)]
    summaries = x.new_zeros((runs.max_runs, b, heads, head_dim, state_size + 1), dtype=torch.float32)
    pending = []  # (row, run position, run, first segment slice) to correct with the incoming state

    def call(row: int, sl: slice, values: torch.Tensor, state: torch.Tensor | None, skip: bool, final: bool):
        dt_, B_, C_ = (t[row : row + 1, sl] for t in (dt, B, C))
        return scan(  # the values by position: transformers names them ``hidden_states``, mamba_ssm ``x``
            values,
            dt=dt_,
            A=A,
            B=B_,
            C=C_,
            D=None if skip else D,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            initial_states=state,
            return_final_states=final,
        )

    if relay:
        step = segment_step(runs, b, lambda row, sl, state: call(row, sl, x[row : row + 1, sl], state, False, True))
        anchor = sum(t.reshape(-1)[0] for t in (x, dt, A, B, C))
        pieces, token = relay_runs(step, runs, (b, heads, head_dim, state_size), anchor, group)
        return touch(torch.cat(pieces, dim=1), token).contiguous()

    for row in range(b):
        for i, run in enumerate(runs.mine):
            slices, continues = runs.segments(row, run)
            pieces = []
            for n, sl in enumerate(slices):
                if n == len(slices) - 1:  # the last segment: its final state is the run's S_ext
                    out, final = call(row, sl, x[row : row + 1, sl], None, False, True)
                    summaries[run.index, row, ..., :state_size] = final[0]
                else:
                    out = call(row, sl, x[row : row + 1, sl], None, False, False)
                pieces.append(out)
                if n == 0 and continues:
                    pending.append((row, i, run, sl))
            if continues and len(slices) == 1:  # no document starts in the run: the state decays through all of it
                run_steps = steps[row, run.local_start : run.local_start + run.length]
                decay = run_decay(A, run_steps)  # [H]
                summaries[run.index, row, ..., state_size] = decay[:, None].expand(heads, head_dim)
            outputs[row][i] = pieces

    incoming, gathered = incoming_states(summaries, runs, group, state_size)
    for row, i, run, sl in pending:
        state = incoming[run.index][row : row + 1]
        zeros = x.new_zeros(x[row : row + 1, sl].shape)
        correction = call(row, sl, zeros, state, True, False)
        outputs[row][i][0] = outputs[row][i][0] + correction
    rows = [torch.cat([p for pieces in per_run for p in pieces], dim=1) for per_run in outputs]
    out = torch.cat(rows, dim=0) if b > 1 else rows[0]
    return touch(out, gathered).contiguous()
