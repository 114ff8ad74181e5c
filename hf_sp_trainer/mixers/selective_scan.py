"""Mamba1's selective scan (Jamba, Mamba, FalconMamba, Zamba) under SP, exact: the model's own scan over this rank's
runs, with the state carried in from the runs before them (``linear_state``).

The scan ``h_t = exp(dt_t A) ⊙ h_{t-1} + dt_t x_t B_t^T``, ``y_t = (C_t h_t + D x_t) silu(z_t)`` (a state ``[d, N]``
per channel and state dimension, ``dt`` after ``+ delta_bias`` and softplus) is affine in its initial state with an
*elementwise* transition: a run from ``h_in`` ends in ``exp(A ⊙ sum_t dt_t) ⊙ h_in + S_ext``, so the state joins the
shared carry loop as ``[d, N, 1]`` with a one-column ``M``. The kernel (transformers' torch path, mamba-ssm's
``selective_scan_fn``) takes no initial state, so what an incoming state adds to the segment that continues a
document is computed here in closed form: ``y_t += (C_t · (exp(A ⊙ sum_{s<=t} dt_s) ⊙ h_in)) silu(z_t)`` (``x = 0``:
``D x`` vanishes), in tiles of ``TILE_ELEMENTS`` recomputed in the backward, so it never holds ``[d, N]`` per token
of a long segment at once. Each document segment is otherwise scanned alone from zero: packed documents never leak.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .linear_state import Recurrence, carry_runs
from .runs import Run, ShardRuns

TILE_ELEMENTS = 1 << 24  # fp32 elements of one tile of the closed-form correction (64 MiB)


def discretised_steps(delta: torch.Tensor, delta_bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    """The step sizes the scan discretises with (fp32, ``[b, d, L]``): ``delta + delta_bias``, softplus."""
    dt = delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[:, None]
    return F.softplus(dt) if softplus else dt


def state_output(
    A: torch.Tensor, steps: torch.Tensor, C: torch.Tensor, state: torch.Tensor, tile_elements: int = TILE_ELEMENTS
) -> torch.Tensor:
    """``C_t · (exp(A ⊙ sum_{s<=t} dt_s) ⊙ state)`` for every step of a segment (``steps [1, d, n]`` fp32, ``C
    [1, N, n]``, ``state [1, d, N]``): what ``state`` adds to the scan's output before the gate, ``[1, d, n]`` fp32.
    Tiles of ``tile_elements`` ``[d, N]`` entries, each recomputed in the backward when there are several."""
    elapsed = steps.cumsum(-1)
    A = A.float()
    d, n_state = A.shape
    tile = max(1, tile_elements // (d * n_state))

    def piece(elapsed_: torch.Tensor, C_: torch.Tensor, state_: torch.Tensor, A_: torch.Tensor) -> torch.Tensor:
        decay = torch.exp(A_[None, :, :, None] * elapsed_[:, :, None, :])  # [1, d, N, T]
        return torch.einsum("bdnt,bdn,bnt->bdt", decay, state_, C_.float())

    length = steps.shape[-1]
    if length <= tile:
        return piece(elapsed, C, state, A)
    pieces = [
        checkpoint(piece, elapsed[..., lo : lo + tile], C[..., lo : lo + tile], state, A, use_reentrant=False)
        for lo in range(0, length, tile)
    ]
    return torch.cat(pieces, dim=-1)


def sp_selective_scan(
    scan: Callable,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    runs: ShardRuns,
    group: dist.ProcessGroup | None,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    relay: bool = False,
    carry_state: bool = True,
) -> torch.Tensor:
    """The model's selective ``scan`` on this rank's shard (``u``, ``delta``, ``z`` ``[b, d, L]``, ``A [d, N]``,
    ``B``/``C`` ``[b, N, L]``), each document as if alone; the scan's output ``[b, d, L]``. ``relay``: the state
    handed rank to rank (``relay.py``) instead of gathered; ``carry_state=False``: a negative control for tests."""
    if B.ndim != 3 or C.ndim != 3:
        raise ValueError(
            f"Mamba1's selective scan under SP takes B and C of shape [batch, d_state, seq] (got {tuple(B.shape)}, "
            f"{tuple(C.shape)}): grouped B / C is not supported; use sp_size=1 for this model."
        )
    b, d, _ = u.shape
    n_state = A.shape[-1]
    steps = discretised_steps(delta, delta_bias, delta_softplus)

    def part(t: torch.Tensor | None, row: int, sl: slice) -> torch.Tensor | None:
        return None if t is None else t[row : row + 1, ..., sl]

    def correction(row: int, sl: slice, state: torch.Tensor) -> torch.Tensor:  # [1, d, n] fp32, gated
        y = state_output(A, steps[row : row + 1, :, sl], C[row : row + 1, :, sl], state[..., 0])
        gate = part(z, row, sl)
        return y if gate is None else y * F.silu(gate.float())

    def segment(row: int, sl: slice, state: torch.Tensor | None, final: bool):
        result = scan(  # by position: transformers names them ``hidden_states, dt``, mamba-ssm ``u, delta``
            u[row : row + 1, :, sl],
            part(delta, row, sl),
            A,
            part(B, row, sl),
            part(C, row, sl),
            D=D,
            z=part(z, row, sl),
            delta_bias=delta_bias,
            delta_softplus=delta_softplus,
            return_last_state=final,
        )
        out, last = result if final else (result, None)
        if state is not None:  # the relay: this segment continues from the state handed over
            out = out + correction(row, sl, state).to(out.dtype)
            decay = torch.exp(A.float() * steps[row, :, sl].sum(-1)[:, None])
            last = last.float() + decay * state[0, ..., 0]
        final_state = None if last is None else last.float().reshape(1, d, n_state, 1)
        return out.transpose(1, 2), final_state

    def transition(row: int, run: Run) -> torch.Tensor:
        total = steps[row, :, run.local_start : run.local_start + run.length].sum(-1)  # [d]
        return torch.exp(A.float() * total[:, None])[..., None]  # [d, N, 1]

    def correct(row: int, sl: slice, state: torch.Tensor) -> torch.Tensor:
        return correction(row, sl, state).to(u.dtype).transpose(1, 2)

    rec = Recurrence(
        rows=b,
        state=(d, n_state, 1),
        m_cols=1,
        inputs=tuple(t for t in (u, delta, A, B, C, z) if t is not None),
        scan=segment,
        correct=correct,
        transition=transition,
    )
    return carry_runs(rec, runs, group, carry_state=carry_state, relay=relay).transpose(1, 2).contiguous()
