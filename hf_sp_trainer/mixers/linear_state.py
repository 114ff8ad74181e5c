"""Carrying a linear recurrence's state across SP ranks: affine summaries, gathered once per layer.

Every linear recurrence ``S_t = A_t S_{t-1} + B_t`` (GDN's delta rule, Mamba2's SSD, ...) is affine in its initial
state once its gates are fixed: a run ends in ``M S_in + S_ext``, with ``S_ext`` the state reached from zero and ``M``
the product of its transitions (``M = 0`` when a document starts inside the run: nothing before it carries over).
``M`` is a ``[K, K]`` matrix (GDN) or, as one column, a scalar per row of the state (Mamba2's per-head decay
``exp(A_h sum_t dt_t)``, repeated over the head's rows): ``M S`` is then elementwise, which for ``K = 1`` is the same.
Each rank computes its runs from a zero state, the SP group all-gathers the ``(S_ext, M)`` pairs (fp32, a size
independent of the length), and each rank folds the runs before each of its own in global order to get the state
its first document segment continues from. The gather is differentiable, so autograd gives the exact backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.gather import all_gather_stack
from .runs import Run, ShardRuns


def incoming_states(
    summaries: torch.Tensor, runs: ShardRuns, group: dist.ProcessGroup, state_cols: int
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """``summaries [max_runs, b, H, K, state_cols + K or + 1]`` (this rank's runs: ``[S_ext | M]``, ``M`` acting on
    the left of the ``[K, state_cols]`` state, or scaling its rows when it is one column) -> ``{run index: S_in
    [b, H, K, state_cols]}`` for this rank's runs, and the gathered tensor (every rank's result must depend on it, so
    that every rank's backward joins its all-reduce).
    """
    gathered = all_gather_stack(summaries.float(), group)  # [P, max_runs, b, H, K, state_cols + K or + 1]
    incoming = {}
    for run in runs.mine:
        incoming[run.index] = fold_before(gathered, runs, run, state_cols)
    return incoming, gathered


def fold_before(gathered: torch.Tensor, runs: ShardRuns, run: Run, state_cols: int) -> torch.Tensor:
    """``S <- M_j S + S_ext_j`` over the runs before ``run`` in global order, from a zero state; the fold starts at
    the last run where every row starts a document (``M = 0`` there for every row)."""
    earlier = [j for j in runs.runs if j.end <= run.start]
    first = 0
    for i, j in enumerate(earlier):
        if all(runs.starts_in(row, j) for row in range(runs.is_start.shape[0])):
            first = i
    state = None
    for j in earlier[first:]:
        summary = gathered[j.rank, j.index]
        s_ext, m = summary[..., :state_cols], summary[..., state_cols:]
        state = s_ext if state is None else _apply(m, state) + s_ext
    if state is None:
        shape = gathered.shape[2:-1] + (state_cols,)
        state = gathered.new_zeros(shape)
    return state


def _apply(m: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``M S``: a matrix product, or row scaling when ``M`` is one column (a scalar decay per state row)."""
    return m * state if m.shape[-1] == 1 else m @ state


def touch(out: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """``out`` with a zero-valued dependence on ``tensors``: a rank that needs nothing gathered still runs the
    gather's backward collective in step with the others."""
    for t in tensors:
        out = out + (t.sum() * 0).to(out.dtype)
    return out
