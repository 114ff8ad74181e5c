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
``varlen=True`` (the installed scan keeps segments apart by ``seq_idx``, as mamba_ssm's does: ``varlen_checks.
seq_idx_capable``) scans each run's segments in one call, whose final state is its last segment's (mamba_ssm's
per-segment ``return_varlen_states`` has no backward, so not one call for all runs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .linear_state import Piece, Recurrence, SegmentBatch, carry_runs, laid_end_to_end
from .runs import Run, ShardRuns


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
    varlen: bool = False,
) -> torch.Tensor:
    """The model's chunked ``scan`` on this rank's shard (``x [b, L, H, P]``, ``dt [b, L, H]``, ``B``/``C``
    ``[b, L, G, N]``), each document as if alone; the scan's output ``[b, L, H, P]``. ``relay``: the state handed
    rank to rank (``relay.py``) instead of gathered; ``varlen``: the scan takes ``seq_idx`` (module docstring)."""
    b, _, heads, head_dim = x.shape
    steps = step_sizes(dt, dt_bias, dt_softplus, dt_limit)

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

    def segment(row: int, sl: slice, state: torch.Tensor | None, final: bool):
        result = call(row, sl, x[row : row + 1, sl], state, False, final)
        return result if final else (result, None)

    def transition(row: int, run: Run) -> torch.Tensor:
        decay = run_decay(A, steps[row, run.local_start : run.local_start + run.length])  # [H]
        return decay[:, None, None].expand(heads, head_dim, 1)

    def correct(row: int, sl: slice, state: torch.Tensor) -> torch.Tensor:  # x = 0: D x vanishes
        return call(row, sl, x.new_zeros(x[row : row + 1, sl].shape), state, True, False)

    def scan_runs(runs: list[list[Piece]]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each run's segments in one call, kept apart by ``seq_idx``; the call's final state is its last one's."""
        outs, finals = [], []
        for pieces in runs:
            lengths = torch.tensor([sl.stop - sl.start for _, sl in pieces])
            seq_idx = torch.repeat_interleave(torch.arange(len(pieces), dtype=torch.int32), lengths)[None]
            values, dt_, B_, C_ = (laid_end_to_end(t, pieces) for t in (x, dt, B, C))
            out, final = scan(
                values, dt=dt_, A=A, B=B_, C=C_, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                initial_states=None, seq_idx=seq_idx.to(x.device), return_final_states=True,
            )  # fmt: skip
            outs += list(out.split(lengths.tolist(), dim=1))
            finals.append(final[0])
        return outs, torch.stack(finals)

    rec = Recurrence(
        rows=b,
        state=(heads, head_dim, B.shape[-1]),
        m_cols=1,
        inputs=(x, dt, A, B, C),
        scan=segment,
        correct=correct,
        transition=transition,
        batch=SegmentBatch(scan_runs) if varlen else None,
    )
    return carry_runs(rec, runs, group, relay=relay).contiguous()
