"""Qwen4-Exp's per-layer embeddings (PLE) under SP, exact: hashed n-grams of the previous token ids and a dilated
depthwise convolution, each document alone.

A PLE layer embeds, for every token, hashes of the ``ngram_size - 1`` ids before it (an EOS token restarts the
history, and so does the start of the input), gates the embedding by the hidden state and adds a depthwise
``nn.Conv1d`` of kernel ``K`` and dilation ``d`` over the sequence, zero-padded in front. Under SP a shard's first
tokens lack the ids and the conv inputs before them, and a packed row's documents would read each other's. So:

- **n-grams** (``document_ngrams``): every rank's ids are all-gathered (one int64 per token, no gradient), and the
  installed embedding runs on each document piece of this rank's runs with the ``<= ngram_size - 1`` ids of its own
  document in front, whose outputs are dropped: a piece that starts a document starts the input, as the document
  alone does; EOS tokens inside restart the history as before.
- **the conv** (``sp_dilated_conv``): a dilated conv is a causal conv of width ``(K - 1) d + 1`` whose taps between
  the dilated ones are zero, so it runs as SP's causal conv (``causal_conv``: the halo of the previous rank, taps
  masked at document starts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm.gather import all_gather_stack
from .causal_conv import sp_causal_conv1d
from .runs import ShardRuns


def whole_ids(ids: torch.Tensor, runs: ShardRuns, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[b, seq]``: the ids of the whole sequence, from this rank's shard ``ids`` (``[b, L]``) and every other's."""
    gathered = all_gather_stack(ids.contiguous(), group)  # [P, b, L]
    whole = ids.new_zeros(ids.shape[0], runs.doc_id.shape[1])
    for run in runs.runs:
        whole[:, run.start : run.end] = gathered[run.rank][:, run.local_start : run.local_start + run.length]
    return whole


def document_ngrams(embed: Callable, module: torch.nn.Module, whole: torch.Tensor, runs: ShardRuns) -> torch.Tensor:
    """``[b, L, E]``: the installed n-gram embedding ``embed(module, input_ids=..., cache=None)`` of this rank's
    tokens, each computed from its own document's ids only (``whole``: the whole sequence's ids)."""
    history = module.context_len
    rows = []
    for row in range(whole.shape[0]):
        starts = runs.is_start[row].nonzero().flatten().tolist()
        pieces = []
        for run in sorted(runs.mine, key=lambda r: r.local_start):
            for piece in runs.segments(row, run)[0]:
                first = run.start + piece.start - run.local_start  # its global position
                doc_start = starts[int(runs.doc_id[row, first])]
                front = min(history, first - doc_start)
                ids = whole[row : row + 1, first - front : first + piece.stop - piece.start]
                pieces.append(embed(module, input_ids=ids, cache=None)[:, front:])
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


def dilated_as_causal(weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """A depthwise ``nn.Conv1d`` weight ``[C, 1, K]`` of dilation ``d`` as a causal conv's ``[C, (K - 1) d + 1]``
    (``causal_conv``'s layout: column ``i`` multiplies the input ``(K - 1) d - i`` tokens back)."""
    channels, _, kernel = weight.shape
    dense = weight.new_zeros(channels, (kernel - 1) * dilation + 1)
    dense[:, ::dilation] = weight[:, 0]
    return dense


def sp_dilated_conv(
    hidden_states: torch.Tensor, conv: torch.nn.Conv1d, runs: ShardRuns, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``silu(conv(hidden_states))`` (``[b, L, C]``, zero-padded in front) as each document alone computes it."""
    weight = dilated_as_causal(conv.weight, conv.dilation[0])
    out = sp_causal_conv1d(hidden_states.transpose(1, 2), weight, conv.bias, "silu", runs, group)
    return out.transpose(1, 2)
