"""Process groups: world = dp x sp, each SP group a block of contiguous ranks, split into ulysses x ring.

Inside an SP group of ``sp = ulysses x ring`` ranks, Ulysses groups are the inner, contiguous blocks of ``ulysses``
ranks (intra-node, where the all-to-all is cheapest) and each ring runs across them (ranks ``ulysses`` apart):
``sp_rank = ring_rank * ulysses + ulysses_rank``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class SPTopology:
    """Where this rank sits: SP group ``dp_rank`` (ranks ``dp_rank*sp .. dp_rank*sp+sp-1``), position ``sp_rank``."""

    sp_size: int
    ring_size: int
    world_size: int
    rank: int
    sp_group: dist.ProcessGroup
    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup

    @property
    def ulysses_size(self) -> int:
        return self.sp_size // self.ring_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.ulysses_size

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses_size


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


def check_ring_size(sp_size: int, ring_size: int | None) -> None:
    """``sp_ring_size`` must be a positive divisor of ``sp_size`` (or None: chosen from the model's heads)."""
    if ring_size is None:
        return
    if not isinstance(ring_size, int) or ring_size < 1 or sp_size % ring_size:
        raise ValueError(
            f"sp_ring_size={ring_size!r} must be a positive divisor of sp_size={sp_size} (sp = ulysses x ring): one "
            f"of {[d for d in range(1, sp_size + 1) if sp_size % d == 0]}, or None to choose it from the model's heads."
        )


def split_sp_size(sp_size: int, num_heads: int, ring_size: int | None = None) -> tuple[int, int]:
    """``(ulysses, ring)`` with ``ulysses x ring = sp_size``.

    By default the largest Ulysses degree dividing both ``sp_size`` and the query heads (kv heads are replicated as
    needed), the rest a ring. ``ring_size`` overrides the split; it must leave a Ulysses degree dividing the heads.
    """
    check_ring_size(sp_size, ring_size)
    if ring_size is None:
        ulysses = max(d for d in range(1, sp_size + 1) if sp_size % d == 0 and num_heads % d == 0)
        return ulysses, sp_size // ulysses
    ulysses = sp_size // ring_size
    if num_heads % ulysses:
        ring_options = [sp_size // d for d in range(1, sp_size + 1) if sp_size % d == 0 and num_heads % d == 0]
        raise ValueError(
            f"sp_size={sp_size} with sp_ring_size={ring_size} leaves a Ulysses degree of {ulysses}, which does not "
            f"divide the model's {num_heads} query heads. Use sp_ring_size in {sorted(ring_options)} (or None)."
        )
    return ulysses, ring_size


@functools.cache
def sp_topology(sp_size: int, ring_size: int = 1) -> SPTopology:
    """Build (once per split) the SP, Ulysses and ring groups of the current default process group.

    Every rank creates every group, in the same order (``new_group`` is collective over the default group).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    check_world(sp_size, world)
    check_ring_size(sp_size, ring_size)
    ulysses = sp_size // ring_size
    mine: dict[str, dist.ProcessGroup] = {}
    for start in range(0, world, sp_size):
        block = list(range(start, start + sp_size))
        groups = {"sp": [block]}
        groups["ulysses"] = [block[i : i + ulysses] for i in range(0, sp_size, ulysses)]
        groups["ring"] = [block[u::ulysses] for u in range(ulysses)]
        for kind, rank_lists in groups.items():
            for ranks in rank_lists:
                group = ranks_group(tuple(ranks))
                if rank in ranks:
                    mine[kind] = group
    return SPTopology(
        sp_size=sp_size,
        ring_size=ring_size,
        world_size=world,
        rank=rank,
        sp_group=mine["sp"],
        ulysses_group=mine["ulysses"],
        ring_group=mine["ring"],
    )


def ranks_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """One process group per set of ranks, created once (a ring of one rank and the SP group of a pure ring share
    the same rank sets with other groups)."""
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def release_groups() -> None:
    """Destroy the groups built here (before the default process group goes away) and forget them."""
    if dist.is_initialized():
        for group in _GROUPS.values():
            dist.destroy_process_group(group)
    _GROUPS.clear()
    sp_topology.cache_clear()


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
