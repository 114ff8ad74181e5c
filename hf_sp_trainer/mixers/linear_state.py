"""Carrying a linear recurrence's state across SP ranks: affine summaries, gathered once per layer.

Every linear recurrence ``S_t = A_t S_{t-1} + B_t`` (GDN's delta rule, Mamba2's SSD, ...) is affine in its initial
state once its gates are fixed: a run ends in ``M S_in + S_ext``, with ``S_ext`` the state reached from zero and ``M``
the product of its transitions (``M = 0`` when a document starts inside the run: nothing before it carries over).
``M`` is a ``[K, K]`` matrix (GDN) or, as one column, a scalar per row of the state (Mamba2's per-head decay
``exp(A_h sum_t dt_t)``, repeated over the head's rows): ``M S`` is then elementwise, which for ``K = 1`` is the same.
Each rank computes its runs from a zero state, the SP group all-gathers the ``(S_ext, M)`` pairs (fp32, a size
independent of the length), and each rank folds the runs before each of its own in global order to get the state
its first document segment continues from. The gather is differentiable, so autograd gives the exact backward.

``carry_runs`` is that loop, shared by every recurrence (``gated_deltanet``, ``mamba2``, ``lightning``), which
supplies only its own arithmetic as a ``Recurrence``: the scan of a segment from a given state, the transition ``M``
of a run in which no document starts, and the output an incoming state adds to a segment. For every row and every
run of this rank:

1. each document segment of the run is scanned alone, from a zero state;
2. the run's summary ``[S_ext | M]`` is stored: ``S_ext`` the last segment's final state, ``M`` the run's transition
   when no document starts in it (0 otherwise);
3. the run's first segment is remembered when it continues a document begun before the run.

The summaries are gathered and folded (``incoming_states``); each remembered segment adds the correction for the
state its run starts in (``o(x, S_in) = o(x, 0) + o(0, S_in)``: the recurrence is affine in its initial state), and
the rows are put back together. ``relay=True`` runs the same scans through ``relay.py`` instead.

The scans of step 1 (grouped by run), the runs passed through at once and the corrections are each asked for as
one list: a recurrence whose kernel keeps packed segments apart supplies a ``SegmentBatch`` and runs a list in one
kernel call (FLA's ``cu_seqlens``: at most three calls per layer and rank however many documents its shard holds) or
one call per run (mamba_ssm's ``seq_idx``); otherwise the list is run segment by segment.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.gather import all_gather_stack
from .relay import relay_runs, segment_step
from .runs import Run, ShardRuns

Scan = Callable[[int, slice, torch.Tensor | None, bool], tuple[torch.Tensor, torch.Tensor | None]]
Piece = tuple[int, slice]  # one document segment: (row, slice of the rank's shard)


@dataclass(frozen=True)
class SegmentBatch:
    """Many document segments per kernel call (a kernel taking ``cu_seqlens`` or ``seq_idx``). ``scan(runs) ->
    (outputs [1, n_i, ...] of every segment in order, final states [len(runs), heads, K, cols])``: each run's
    segments (a list of pieces) each from a zero state, the final state its last segment's. Optional (else segment by
    segment): ``correct(pieces, S_in [len(pieces), heads, K, cols]) -> outputs``, what each ``S_in`` adds to its
    segment; ``through(pieces) -> (outputs, [S_ext | M] [len(pieces), heads, K, cols + m_cols])``, runs with no
    document start (as ``Recurrence.through``)."""

    scan: Callable[[list[list[Piece]]], tuple[list[torch.Tensor], torch.Tensor]]
    correct: Callable[[list[Piece], torch.Tensor], list[torch.Tensor]] | None = None
    through: Callable[[list[Piece]], tuple[list[torch.Tensor], torch.Tensor]] | None = None


def laid_end_to_end(t: torch.Tensor, pieces: list[Piece]) -> torch.Tensor:
    """``t``'s ``pieces`` (of its rows ``[b, L, ...]``) as one row ``[1, n, ...]``: a view when they follow each other
    in ``t``'s memory order (a rank's documents in a row, rows in order), else a copy."""
    length = t.shape[1]
    flat = [(row * length + sl.start, row * length + sl.stop) for row, sl in pieces]
    if all(before[1] == after[0] for before, after in itertools.pairwise(flat)):
        return t.reshape(1, -1, *t.shape[2:])[:, flat[0][0] : flat[-1][1]]
    return torch.cat([t[row : row + 1, sl] for row, sl in pieces], dim=1)


@dataclass(frozen=True)
class Recurrence:
    """What ``carry_runs`` needs of one linear recurrence on this rank's shard (``rows`` rows; a state ``[heads, K,
    cols]`` per row).

    ``scan(row, shard slice, S_in [1, heads, K, cols] fp32 or None, final) -> (output [1, n, ...], final state
    [1, heads, K, cols] or None when not ``final``)``: one document segment of one row, from ``S_in`` (``None``: zero).
    ``transition(row, run) -> M [heads, K, m_cols]``: the transition of a run in which no document starts.
    ``correct(row, shard slice, S_in) -> output [1, n, ...]``: what ``S_in`` adds to a segment's output.
    ``through(row, shard slice) -> (output, [S_ext | M] [heads, K, cols + m_cols])``, optional: a run with no document
    start at once (GDN's widened kernel call), instead of ``scan`` and ``transition``.
    ``batch``, optional: the same three for many segments per kernel call (``SegmentBatch``; the relay runs ``scan``).
    ``inputs``: the differentiable inputs (the relay's chain is anchored on them).
    """

    rows: int
    state: tuple[int, int, int]  # (heads, K, cols): one row's state
    m_cols: int  # K when M is a matrix acting on the left, 1 when it scales the state's rows
    inputs: tuple[torch.Tensor, ...]
    scan: Scan
    correct: Callable[[int, slice, torch.Tensor], torch.Tensor]
    transition: Callable[[int, Run], torch.Tensor] | None = None
    through: Callable[[int, slice], tuple[torch.Tensor, torch.Tensor]] | None = None
    batch: SegmentBatch | None = None

    def scan_runs(self, runs: list[list[Piece]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each run's segments from zero states: every segment's output (in order) and each run's final state
        ``[heads, K, cols]`` (its last segment's)."""
        if not runs:
            return [], []
        if self.batch is not None:
            outs, states = self.batch.scan(runs)
            return outs, list(states.unbind(0))
        outs, finals = [], []
        for pieces in runs:
            for n, (row, sl) in enumerate(pieces):
                out, state = self.scan(row, sl, None, n == len(pieces) - 1)
                outs.append(out)
            finals.append(state[0])
        return outs, finals

    def through_pieces(self, pieces: list[Piece]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Runs with no document start: each one's output and ``[S_ext | M]``."""
        if not pieces:
            return [], []
        if self.batch is not None and self.batch.through is not None:
            outs, summaries = self.batch.through(pieces)
            return outs, list(summaries.unbind(0))
        results = [self.through(row, sl) for row, sl in pieces]
        return [out for out, _ in results], [summary for _, summary in results]

    def correct_pieces(self, pieces: list[Piece], states: torch.Tensor) -> list[torch.Tensor]:
        """What each incoming state (``states [len(pieces), heads, K, cols]``) adds to its segment's output."""
        if self.batch is not None and self.batch.correct is not None:
            return self.batch.correct(pieces, states)
        return [self.correct(row, sl, states[n : n + 1]) for n, (row, sl) in enumerate(pieces)]


def carry_runs(
    rec: Recurrence,
    runs: ShardRuns,
    group: dist.ProcessGroup | None,
    carry_state: bool = True,
    relay: bool = False,
) -> torch.Tensor:
    """``rec`` over this rank's runs, each document as if alone, with the state carried in from the runs before them
    (the module docstring's loop); the output ``[rows, L, ...]``. ``carry_state=False`` (a negative control for
    tests) starts every run from a zero state; ``relay``: the state handed rank to rank (``relay.py``) instead of
    gathered."""
    if relay:
        step = segment_step(runs, rec.rows, lambda row, sl, state: rec.scan(row, sl, state, True))
        anchor = sum(t.reshape(-1)[0] for t in rec.inputs)
        pieces, token = relay_runs(step, runs, (rec.rows, *rec.state), anchor, group)
        return touch(torch.cat(pieces, dim=1), token)

    heads, k, cols = rec.state
    device = rec.inputs[0].device
    summaries = torch.zeros((runs.max_runs, rec.rows, heads, k, cols + rec.m_cols), dtype=torch.float32, device=device)
    outputs = [[[] for _ in runs.mine] for _ in range(rec.rows)]
    passed, scanned, pending = [], [], []  # (row, run position, run, segment slice, ...): what each list is for
    for row in range(rec.rows):
        for i, run in enumerate(runs.mine):
            slices, continues = runs.segments(row, run)
            through = continues and len(slices) == 1  # no document starts in the run: M carries a state through it
            if through and rec.through is not None:
                passed.append((row, i, run, slices[0]))
            else:  # each segment alone, from zero; the last one's final state is the run's S_ext
                scanned.append((row, i, run, slices, through))
            if continues:
                pending.append((row, i, run, slices[0]))

    outs, passed_summaries = rec.through_pieces([(row, sl) for row, _, _, sl in passed])
    for (row, i, run, _), out, summary in zip(passed, outs, passed_summaries, strict=True):
        summaries[run.index, row] = summary
        outputs[row][i].append(out)
    outs, finals = rec.scan_runs([[(row, sl) for sl in slices] for row, _, _, slices, _ in scanned])
    outs = iter(outs)
    for (row, i, run, slices, through), final in zip(scanned, finals, strict=True):
        outputs[row][i] += [next(outs) for _ in slices]
        summaries[run.index, row, ..., :cols] = final
        if through:
            summaries[run.index, row, ..., cols:] = rec.transition(row, run)

    incoming, gathered = incoming_states(summaries, runs, group, cols)
    if carry_state and pending:
        states = torch.stack([incoming[run.index][row] for row, _, run, _ in pending])
        corrections = rec.correct_pieces([(row, sl) for row, _, _, sl in pending], states)
        for (row, i, _, _), correction in zip(pending, corrections, strict=True):
            outputs[row][i][0] = outputs[row][i][0] + correction
    per_row = [torch.cat([p for pieces in per_run for p in pieces], dim=1) for per_run in outputs]
    out = torch.cat(per_row, dim=0) if rec.rows > 1 else per_row[0]
    return touch(out, gathered)


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
