"""Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid, ...) under SP, exact: the chunked delta rule over this rank's
runs, with the state carried in from the runs before them (``linear_state``).

The delta rule ``S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` acts on the left of the ``[K, V]``
state, column by column, so one call of the model's own kernel on values ``[v | 0]`` from the initial state
``[0 | I]`` yields a run's output from zero, its ``S_ext`` and its transition ``M`` (``[K, K]``) at once. Each
document segment inside a run is computed alone (packed documents never leak into each other), and the segment
that continues a document from an earlier rank adds the kernel's output for values 0 from the incoming state:
``o(v, S_in) = o(v, 0) + o(0, S_in)``. ``relay=True`` (``sp_state_passing="relay"``, a debugging aid) runs the
first segment from the state handed over by the rank before instead (``relay``).

``varlen=True`` (the installed kernel takes ``cu_seqlens``, as FLA's does: ``varlen_checks.varlen_capable``) runs
each of those lists of segments (from zero; the widened runs; the corrections) as one sequence of segments in one kernel
call, each segment from its own initial state with its own final state: at most three calls per layer and rank
instead of one per document segment.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist

from .linear_state import Piece, Recurrence, SegmentBatch, carry_runs, laid_end_to_end
from .runs import ShardRuns


def sp_chunk_gated_delta_rule(
    core: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    runs: ShardRuns,
    group: dist.ProcessGroup,
    carry_state: bool = True,
    relay: bool = False,
    varlen: bool = False,
    **options,
) -> tuple[torch.Tensor, None]:
    """The model's chunked delta-rule ``core`` on this rank's shard (``[b, L, heads, dim]``, ``g``/``beta``
    ``[b, L, v_heads]``), each document as if alone. ``options``: the core's other keyword arguments.
    ``carry_state=False`` (a negative control for tests) starts every run from a zero state; ``relay``: the
    state handed rank to rank (``relay.py``) instead of gathered; ``varlen``: the core takes ``cu_seqlens`` (the
    module docstring)."""
    if options.pop("initial_state", None) is not None or options.pop("output_final_state", False):
        raise ValueError("Gated DeltaNet under sequence parallelism runs without a cache (use_cache=False).")
    options.pop("cu_seqlens", None)
    b, _, v_heads, v_dim = value.shape
    k_dim = key.shape[-1]

    def call(row: int, sl: slice, v: torch.Tensor, state: torch.Tensor | None, final: bool):
        q, k, gate, b_ = (t[row : row + 1, sl] for t in (query, key, g, beta))
        return core(q, k, v, g=gate, beta=b_, initial_state=state, output_final_state=final, **options)

    def through(row: int, sl: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Values ``[v | 0]`` from ``[0 | I]``: the output from zero, ``S_ext`` and ``M`` in one call."""
        v = value[row : row + 1, sl]
        widened = torch.cat([v, v.new_zeros(*v.shape[:-1], k_dim)], -1)
        eye = torch.eye(k_dim, dtype=torch.float32, device=value.device)
        state = torch.cat([eye.new_zeros(k_dim, v_dim), eye], -1).expand(1, v_heads, k_dim, -1)
        out, final = call(row, sl, widened, state.contiguous(), True)
        return out[..., :v_dim], final[0]

    def correct(row: int, sl: slice, state: torch.Tensor) -> torch.Tensor:
        return call(row, sl, value.new_zeros(value[row : row + 1, sl].shape), state, False)[0]

    def call_many(pieces: list[Piece], values: torch.Tensor, states: torch.Tensor | None, final: bool):
        """The core once over ``pieces`` laid end to end (``cu_seqlens``) with ``values [1, n, v_heads, ...]``,
        each piece from its state in ``states`` (``None``: zeros): the pieces' outputs and final states."""
        lengths = [sl.stop - sl.start for _, sl in pieces]
        q, k, gate, b_ = (laid_end_to_end(t, pieces) for t in (query, key, g, beta))
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)
        out, last = core(
            q, k, values, g=gate, beta=b_, initial_state=states, output_final_state=final,
            cu_seqlens=cu.to(value.device), cu_seqlens_cpu=cu, **options,
        )  # fmt: skip
        return list(out.split(lengths, dim=1)), last

    def scan_many(runs: list[list[Piece]]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every run's segments in one call; each run's final state is its last segment's."""
        pieces = [piece for run in runs for piece in run]
        outs, finals = call_many(pieces, laid_end_to_end(value, pieces), None, True)
        last = torch.tensor(list(itertools.accumulate(len(run) for run in runs)), device=finals.device) - 1
        return outs, finals.index_select(0, last)

    def through_many(pieces: list[Piece]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``through`` for every piece in one call."""
        v = laid_end_to_end(value, pieces)
        widened = torch.cat([v, v.new_zeros(*v.shape[:-1], k_dim)], -1)
        eye = torch.eye(k_dim, dtype=torch.float32, device=value.device)
        state = torch.cat([eye.new_zeros(k_dim, v_dim), eye], -1).expand(len(pieces), v_heads, k_dim, -1)
        outs, finals = call_many(pieces, widened, state.contiguous(), True)
        return [out[..., :v_dim] for out in outs], finals

    def correct_many(pieces: list[Piece], states: torch.Tensor) -> list[torch.Tensor]:
        zeros = value.new_zeros(1, sum(sl.stop - sl.start for _, sl in pieces), *value.shape[2:])
        return call_many(pieces, zeros, states.contiguous(), False)[0]

    rec = Recurrence(
        rows=b,
        state=(v_heads, k_dim, v_dim),
        m_cols=k_dim,
        inputs=(query, key, value, g, beta),
        scan=lambda row, sl, state, final: call(row, sl, value[row : row + 1, sl], state, final),
        correct=correct,
        through=through,
        batch=SegmentBatch(scan_many, correct=correct_many, through=through_many) if varlen else None,
    )
    return carry_runs(rec, runs, group, carry_state, relay), None
