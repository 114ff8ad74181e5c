"""Process groups: world = dp x sp, each SP group a block of contiguous ranks."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class SPTopology:
    """Where this rank sits: SP group ``dp_rank`` (ranks ``dp_rank*sp .. dp_rank*sp+sp-1``), position ``sp_rank``."""

    sp_size: int
    world_size: int
    rank: int
    sp_group: dist.ProcessGroup

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size


def check_world(sp_size: int, world_size: int) -> None:
    """Raise a ``ValueError`` naming the values if ``sp_size`` can't split ``world_size`` processes."""
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}.")
    if sp_size > 1 and world_size == 1:
        raise ValueError(
            f"sp_size={sp_size} needs {sp_size} processes but this is a single-process run. Launch it distributed, "
            f"e.g. `torchrun --nproc_per_node {sp_size} train.py` or `accelerate launch --num_processes {sp_size}`."
        )
    if world_size % sp_size:
        raise ValueError(
            f"sp_size={sp_size} does not divide the world size {world_size}: world = dp x sp. Use an sp_size among "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]} or launch a multiple of {sp_size} "
            "processes."
        )


@functools.cache
def sp_topology(sp_size: int) -> SPTopology:
    """Build (once per ``sp_size``) the SP groups of the current default process group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_world(sp_size, world)
    groups = [dist.new_group(list(range(start, start + sp_size))) for start in range(0, world, sp_size)]
    return SPTopology(sp_size=sp_size, world_size=world, rank=rank, sp_group=groups[rank // sp_size])
