"""The depthwise causal convolution of hybrid layers (GDN, Mamba2, LFM2's short conv) under SP, exact.

A width-``W`` causal conv reads the ``W - 1`` tokens before each output. Under SP the first outputs of every run
need the tail of the run before it, held by another rank (its **halo**), and no output may read a token of an
earlier document (one device zero-pads each document; transformers' own conv doesn't even do that for packed
rows). Each rank gathers the last ``W - 1`` pre-conv inputs of every run (one small differentiable all-gather:
the halo's gradient goes back to its owner), prepends the halo to each of its runs, and sums the ``W`` taps with
each tap masked where it would cross a document start: what one device computes document by document.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.activations import ACT2FN

from ..comm.gather import all_gather_stack
from .runs import ShardRuns


def sp_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    runs: ShardRuns,
    group: dist.ProcessGroup,
    halo: bool = True,
) -> torch.Tensor:
    """``x [b, C, L]`` (this rank's shard, channels first), ``weight [C, W]`` -> the conv output ``[b, C, L]``, as
    transformers' ``causal_conv1d_fn`` computes it on each document alone. ``halo=False`` (a negative control for
    tests) zero-pads every run instead."""
    width = weight.shape[-1]
    halos = gather_halos(x, width - 1, runs, group)  # [b, C, max_runs, W-1]
    if not halo:
        halos = halos * 0
    xw = x.to(weight.dtype)
    outputs = []
    for run in runs.mine:
        ext = torch.cat(
            [halos[:, :, run.index].to(weight.dtype), xw[:, :, run.local_start : run.local_start + run.length]], -1
        )
        outputs.append(_masked_taps(ext, weight, bias, runs, run.start, run.length))
    out = torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def gather_halos(x: torch.Tensor, size: int, runs: ShardRuns, group: dist.ProcessGroup) -> torch.Tensor:
    """For each of this rank's runs, the ``size`` inputs before it in the global sequence (zeros before position 0):
    ``[b, C, max_runs, size]``. The tails of every rank's runs are gathered once; a halo may span several short runs.
    Every rank's result depends on the gathered tensor, so every rank's backward joins the gradient's all-reduce."""
    b, channels, _ = x.shape
    tails = x.new_zeros(runs.max_runs, b, channels, size)
    for run in runs.mine:
        take = min(size, run.length)
        end = run.local_start + run.length
        tails[run.index, ..., size - take :] = x[:, :, end - take : end]
    gathered = all_gather_stack(tails, group)  # [P, max_runs, b, C, size]
    flat = torch.cat([gathered.permute(2, 3, 0, 1, 4).reshape(b, channels, -1), x.new_zeros(b, channels, 1)], -1)
    zero = flat.shape[-1] - 1
    index = []
    for run in runs.mine:
        for position in range(run.start - size, run.start):
            if position < 0:
                index.append(zero)
                continue
            owner = runs.owner(position)
            offset = size - (owner.end - position)  # its place in the owner's tail
            index.append(((owner.rank * runs.max_runs) + owner.index) * size + offset)
    padded = runs.max_runs - len(runs.mine)
    index += [zero] * (padded * size)
    picked = flat[:, :, torch.tensor(index, device=x.device)]
    return picked.view(b, channels, runs.max_runs, size)


def _masked_taps(
    ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, runs: ShardRuns, start: int, length: int
) -> torch.Tensor:
    """``out[t] = bias + sum_j weight[:, W-1-j] * x[t-j]`` over the taps that stay in ``t``'s document; ``ext`` is the
    run with its ``W - 1`` halo inputs in front (global positions ``start - W + 1 ...``)."""
    width = weight.shape[-1]
    doc = runs.doc_id.to(ext.device)
    rows = doc.shape[0]
    positions = torch.arange(start - width + 1, start + length, device=ext.device)
    ids = torch.where(positions >= 0, doc[:, positions.clamp(min=0)], torch.full_like(doc[:, :1], -1))  # [rows, L+W-1]
    own = ids[:, width - 1 :]
    out = None
    for j in range(width):
        tap = ext[:, :, width - 1 - j : width - 1 - j + length] * weight[:, width - 1 - j, None]
        if j:
            same = (ids[:, width - 1 - j : width - 1 - j + length] == own).to(ext.dtype)  # [rows, L]
            tap = tap * same.view(rows, 1, length)
        out = tap if out is None else out + tap
    if bias is not None:
        out = out + bias[:, None]
    return out
