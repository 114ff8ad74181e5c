"""Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid, ...) under SP, exact: the chunked delta rule over this rank's
runs, with the state carried in from the runs before them (``linear_state``).

The delta rule ``S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` acts on the left of the ``[K, V]``
state, column by column, so one call of the model's own kernel on values ``[v | 0]`` from the initial state
``[0 | I]`` yields a run's output from zero, its ``S_ext`` and its transition ``M`` (``[K, K]``) at once. Each
document segment inside a run is computed alone (packed documents never leak into each other), and the segment
that continues a document from an earlier rank adds the kernel's output for values 0 from the incoming state:
``o(v, S_in) = o(v, 0) + o(0, S_in)``. ``relay=True`` (``sp_state_passing="relay"``, a debugging aid) runs the
first segment from the state handed over by the rank before instead (``relay``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .linear_state import Recurrence, carry_runs
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
    **options,
) -> tuple[torch.Tensor, None]:
    """The model's chunked delta-rule ``core`` on this rank's shard (``[b, L, heads, dim]``, ``g``/``beta``
    ``[b, L, v_heads]``), each document as if alone. ``options``: the core's other keyword arguments.
    ``carry_state=False`` (a negative control for tests) starts every run from a zero state; ``relay``: the
    state handed rank to rank (``relay.py``) instead of gathered."""
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

    rec = Recurrence(
        rows=b,
        state=(v_heads, k_dim, v_dim),
        m_cols=k_dim,
        inputs=(query, key, value, g, beta),
        scan=lambda row, sl, state, final: call(row, sl, value[row : row + 1, sl], state, final),
        correct=correct,
        through=through,
    )
    return carry_runs(rec, runs, group, carry_state, relay), None
