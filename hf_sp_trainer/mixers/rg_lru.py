"""RecurrentGemma's recurrent block (Griffin / Hawk: a depthwise conv, then the RG-LRU) under SP, exact.

The RG-LRU is a diagonal linear recurrence per channel, ``h_t = a_t ⊙ h_{t-1} + x_t`` (``x`` already gated and
normalised by the layer, ``a_t = 0`` where a document starts, which the layer reads from ``position_ids``). A run from
``h_in`` ends in ``(prod a) ⊙ h_in + S_ext``, so the state joins the shared carry loop (``linear_state``) as
``[w, 1, 1]`` with a one-column ``M = prod a``: the gathered summary is two fp32 numbers per channel and run. The
layer's own scan (``_rnn_scan``) runs each document segment from zero; the segment that continues a document adds
``cumprod(a) ⊙ h_in``. The block's conv is an ``nn.Conv1d`` padded on both sides of which the block keeps the first
``L`` outputs: a causal conv over the whole row, across packed documents. Under SP (and at sp_size 1 with documents
kept apart) it runs as SP's causal conv, with its halo and document masks (``causal_conv``): each document alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..documents import current_scope, run_in_scope
from .causal_conv import sp_causal_conv1d
from .linear_state import Recurrence, carry_runs
from .runs import Run, ShardRuns


def sp_rnn_scan(
    scan: Callable,
    x: torch.Tensor,
    a: torch.Tensor,
    reset: torch.Tensor,
    runs: ShardRuns,
    group: dist.ProcessGroup | None,
    relay: bool = False,
    carry_state: bool = True,
) -> torch.Tensor:
    """The RG-LRU's ``scan`` (the layer's ``_rnn_scan``: ``hidden_states``, ``recurrent_gate``, ``reset``,
    ``recurrent_states`` -> output, final state) over this rank's shard, ``x``, ``a`` ``[b, L, w]`` and ``reset``
    ``[b, L, 1]``, each document as if alone: the output ``[b, L, w]``. ``relay``: the state handed rank to rank;
    ``carry_state=False``: a negative control for tests."""
    rows, _, width = x.shape

    def segment(row: int, sl: slice, state: torch.Tensor | None, final: bool):
        out, last = scan(
            hidden_states=x[row : row + 1, sl],
            recurrent_gate=a[row : row + 1, sl],
            reset=reset[row : row + 1, sl],
            recurrent_states=None if state is None else state[:, :, 0, 0],
        )
        return out, last.float().reshape(1, width, 1, 1) if final else None

    def transition(row: int, run: Run) -> torch.Tensor:
        return a[row, run.local_start : run.local_start + run.length].float().prod(0).reshape(width, 1, 1)

    def correct(row: int, sl: slice, state: torch.Tensor) -> torch.Tensor:
        return (a[row : row + 1, sl].float().cumprod(1) * state[:, None, :, 0, 0]).to(x.dtype)

    rec = Recurrence(
        rows=rows, state=(width, 1, 1), m_cols=1, inputs=(x, a), scan=segment, correct=correct, transition=transition
    )
    return carry_runs(rec, runs, group, carry_state=carry_state, relay=relay)


def recurrent_block_forward(
    block: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    runs: ShardRuns,
    group: dist.ProcessGroup | None,
    scope: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """RecurrentGemma's recurrent block on this rank's shard, without a cache: its own projections and RG-LRU (whose
    scan finds the SP kwargs ``scope`` as the innermost SP scope), the conv as SP's causal conv."""
    block.conv1d_state, block.rg_lru.recurrent_states = None, None  # what its forward does without a cache
    y_branch = block.act_fn(block.linear_y(hidden_states))
    x_branch = block.linear_x(hidden_states).transpose(1, 2)
    conv = block.conv_1d
    x_branch = sp_causal_conv1d(x_branch, conv.weight[:, 0], conv.bias, None, runs, group).transpose(1, 2)
    x_branch = run_in_scope((*current_scope(), scope), block.rg_lru, activations=x_branch, position_ids=position_ids)
    return block.linear_out(x_branch * y_branch), None
