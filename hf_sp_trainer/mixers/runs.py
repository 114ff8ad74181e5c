"""Where each SP rank's tokens sit in the whole sequence, and where its documents start.

A recurrent or convolutional mixer carries state from token to token, so under SP each rank must know which
stretches of the global sequence it holds (its **runs**: one with Ulysses, up to two zigzag chunks with a ring) and
which of them continue a document begun on another rank. Both follow from the sharding and the document bounds the
decoder pre-hook already passes to every layer (``sp_document_bounds``): no communication.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..sharding import SequenceSharding


@dataclass(frozen=True)
class Run:
    """A stretch of the global sequence held contiguously by one rank."""

    rank: int
    index: int  # its place among the rank's runs (0 or 1)
    local_start: int  # where it begins in the rank's shard
    start: int  # where it begins in the global sequence
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class ShardRuns:
    """Every rank's runs (in global order) and the documents of every row of the packed batch."""

    runs: tuple[Run, ...]
    rank: int
    max_runs: int  # the most runs any rank holds (summaries are padded to it)
    doc_id: torch.Tensor  # [rows, seq] long: the document of each global position
    is_start: torch.Tensor  # [rows, seq] bool: a document starts at this global position

    @property
    def mine(self) -> list[Run]:
        return [run for run in self.runs if run.rank == self.rank]

    def owner(self, position: int) -> Run:
        """The run holding global ``position``."""
        for run in self.runs:
            if run.start <= position < run.end:
                return run
        raise IndexError(position)

    def starts_in(self, row: int, run: Run) -> list[int]:
        """Offsets (within ``run``) of the documents that start inside it, 0 included when the run starts one."""
        flags = self.is_start[row, run.start : run.end]
        return flags.nonzero().flatten().tolist()

    def segments(self, row: int, run: Run) -> tuple[list[slice], bool]:
        """``run`` of ``row`` cut at its document starts, as slices of the rank's shard, and whether the first
        segment continues a document begun before the run (one segment that continues: no document starts in it)."""
        cuts = self.starts_in(row, run)
        edges = sorted({0, *cuts, run.length})
        slices = [
            slice(run.local_start + lo, run.local_start + hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)
        ]
        return slices, not cuts or cuts[0] != 0


def shard_runs(bounds: torch.Tensor, rows: int, sharding: SequenceSharding, rank: int) -> ShardRuns:
    """The runs of every rank for a forward of ``rows`` rows whose documents are ``bounds`` (document starts over the
    rows laid end to end, then ``rows x seq``: the ``sp_document_bounds`` the SP attention gets)."""
    key = tuple(int(b) for b in bounds.tolist())
    return _shard_runs(key, rows, sharding.sp_size, sharding.ring_size, rank)


@functools.lru_cache(maxsize=16)
def _shard_runs(bounds: tuple[int, ...], rows: int, sp_size: int, ring_size: int, rank: int) -> ShardRuns:
    sharding = SequenceSharding(sp_size, ring_size)
    seq = bounds[-1] // rows
    runs = []
    for r in range(sp_size):
        positions = sharding.positions(seq, r).tolist()
        begin = 0
        for i in range(1, len(positions) + 1):
            if i == len(positions) or positions[i] != positions[i - 1] + 1:
                index = sum(run.rank == r for run in runs)
                runs.append(Run(r, index, begin, positions[begin], i - begin))
                begin = i
    runs.sort(key=lambda run: run.start)
    is_start = torch.zeros(rows * seq, dtype=torch.bool)
    is_start[list(bounds[:-1])] = True
    is_start = is_start.view(rows, seq)
    doc_id = is_start.long().cumsum(dim=1) - 1
    max_runs = max(sum(run.rank == r for run in runs) for r in range(sp_size))
    return ShardRuns(tuple(runs), rank, max_runs, doc_id, is_start)
