"""MiniMax's lightning attention under SP, exact: decayed linear attention over this rank's runs, each document as if
alone, with the state carried in from the runs before them (``linear_state``).

Per head, with a fixed decay ``lambda = exp(-slope)``, the layer computes ``S_t = lambda S_{t-1} + k_t^T v_t`` and
``o_t = q_t S_t`` (``[d, d]`` state), block by block as transformers does: within a block ``(q k^T * decay) v``,
across blocks ``q S`` with the state at the block's start. It is affine in the initial state with a scalar transition
per head: a run of ``n`` tokens from ``S_in`` ends in ``lambda^n S_in + S_ext``, and the segment that continues a
document from an earlier rank adds ``(lambda^(t+1) q_t) S_in`` at its ``t``-th token. transformers' own forward runs
one recurrence over the whole row, so packed documents leak into each other there; here (at every sp_size, 1
included) every document starts from a zero state, as it does when run alone. ``relay=True``
(``sp_state_passing="relay"``) runs the first segment from the state handed over by the rank before instead.

The layer has no kernel function to swap: ``lightning_forward`` is its forward with the recurrence replaced, and
``mixers.swap`` installs it only after checking it against the installed class's own forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .linear_state import Recurrence, carry_runs
from .runs import Run, ShardRuns


def lightning_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, block: int, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed linear attention of one stretch, ``q``/``k``/``v`` ``[b, L, H, d]``, ``slope [H, 1, 1]``, from
    ``state [b, H, d, d]`` (``None``: zero), block by block with transformers' decays; ``(out [b, L, H, d],
    final state)``."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    b, heads, length, dim = q.shape
    if state is None:
        state = q.new_zeros(b, heads, dim, v.shape[-1])
    outputs = []
    for start in range(0, length, block):
        size = min(block, length - start)
        steps = torch.arange(size, device=q.device) + 1
        query_decay = torch.exp(-slope * steps[:, None])
        key_decay = torch.exp(-slope * (size - steps[:, None]))
        lags = slope * (steps[:, None] - steps[None, :])[None]
        diagonal = torch.exp(torch.where(lags >= 0, -lags, float("-inf")))
        qb, kb, vb = (t[:, :, start : start + size] for t in (q, k, v))
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diagonal, vb)
        outputs.append(torch.matmul(qb * query_decay, state) + intra)
        state = state * torch.exp(-slope * size) + torch.matmul((kb * key_decay).transpose(-1, -2), vb)
    return torch.cat(outputs, dim=2).transpose(1, 2), state


def sp_lightning_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    block: int,
    runs: ShardRuns,
    group: dist.ProcessGroup | None,
    relay: bool = False,
    carry_state: bool = True,
) -> torch.Tensor:
    """``lightning_scan`` on this rank's shard (``[b, L, H, d]``), each document as if alone; ``carry_state=False``
    (a negative control for tests) starts every run from a zero state."""
    b, _, heads, dim = q.shape

    def scan(row: int, sl: slice, state: torch.Tensor | None, final: bool) -> tuple[torch.Tensor, torch.Tensor]:
        qs, ks, vs = (t[row : row + 1, sl] for t in (q, k, v))
        return lightning_scan(qs, ks, vs, slope, block, None if state is None else state.to(qs.dtype))

    def transition(row: int, run: Run) -> torch.Tensor:  # lambda^n per head
        decay = torch.exp(-slope.float().view(heads) * run.length)
        return decay[:, None, None].expand(heads, dim, 1)

    def correct(row: int, sl: slice, state: torch.Tensor) -> torch.Tensor:  # (lambda^(t+1) q_t) S_in
        steps = torch.arange(sl.stop - sl.start, device=q.device) + 1
        decay = torch.exp(-slope * steps[:, None])  # [H, n, 1]
        return torch.matmul(q[row : row + 1, sl].transpose(1, 2) * decay, state.to(q.dtype)).transpose(1, 2)

    rec = Recurrence(
        rows=b,
        state=(heads, dim, v.shape[-1]),
        m_cols=1,
        inputs=(q, k, v),
        scan=scan,
        correct=correct,
        transition=transition,
    )
    return carry_runs(rec, runs, group, carry_state, relay)


def lightning_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    runs: ShardRuns,
    group: dist.ProcessGroup | None,
    mask_padding: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
    relay: bool = False,
    carry_state: bool = True,
) -> tuple[torch.Tensor, None]:
    """``MiniMaxLightningAttention.forward`` on this rank's shard with ``sp_lightning_attention`` as its recurrence
    (``mask_padding``: the modeling module's ``apply_mask_to_padding_states``)."""
    b, length, _ = hidden_states.shape
    heads, dim = module.num_attention_heads, module.head_dim
    qkv = mask_padding(module.act_fn(module.qkv_proj(hidden_states)), attention_mask)
    q, k, v = torch.split(qkv.reshape(b, length, heads, 3 * dim), dim, dim=3)
    out = sp_lightning_attention(q, k, v, module.slope_rate, module.block_size, runs, group, relay, carry_state)
    out = module.norm(out.reshape(b, length, heads * dim))
    out = F.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out), None
