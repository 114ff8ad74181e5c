"""The data-parallel view TRL's online-RL step code runs in under SP (``OnlineRLSPMixin._sp_dp_view``).

TRL's gathers, advantage slicing and normalisers count processes; under SP a group's ranks hold one data-parallel
rank's batch, so they must see one copy per SP group: the trainer's ``accelerator`` is a view (a subclass instance
sharing the real accelerator's state, only while TRL's step code runs), and the functions TRL's modules imported
from accelerate (``gather`` for the rewards and RLOO's KL, ``gather_object`` for the logged completions and, in vLLM's
server mode, the prompts; module globals, with no trainer method to override around them) are swapped once through
the patch registry for entries that keep one copy per SP group while a view is active.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from .. import patches

_DP_VIEWS: list = []  # the topology of each active view (innermost last)
_VIEW_CLASSES: dict[type, type] = {}


@contextlib.contextmanager
def gathers_per_group(topo) -> Iterator[None]:
    """Within: the swapped module-level gathers keep one copy per SP group of ``topo``."""
    _DP_VIEWS.append(topo)
    try:
        yield
    finally:
        _DP_VIEWS.pop()


def _dp_rows(full: torch.Tensor, topo) -> torch.Tensor:
    """Rows of a whole-world gather (rank order) kept once per SP group: the first rank's of each."""
    if full.ndim == 0:
        return full
    return torch.cat(full.chunk(topo.dp_size * topo.sp_size)[0 :: topo.sp_size])


def _dp_items(full: list, topo) -> list:
    world, step = topo.dp_size * topo.sp_size, topo.sp_size
    if len(full) % world:
        raise RuntimeError(f"gather_object: {len(full)} items over {world} ranks are not equal per rank.")
    n = len(full) // world
    return [x for r in range(0, world, step) for x in full[r * n : (r + 1) * n]]


class DataParallelView:
    """Mixed in front of the accelerator's class: one process per data-parallel rank (an SP group counted once)."""

    __slots__ = ()  # the view's own topology is a slot of its class; everything else is the accelerator's state

    @property
    def num_processes(self) -> int:
        return self._sp_topology.dp_size

    @property
    def process_index(self) -> int:
        return self._sp_topology.dp_rank

    def gather(self, tensor):
        return _dp_rows(super().gather(tensor), self._sp_topology)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        out = super().reduce(tensor, reduction=reduction, scale=scale)
        return out / self._sp_topology.sp_size if reduction == "sum" else out  # each SP group once (sp = 2^k: exact)


def dp_accelerator_view(accelerator, topo):
    """A data-parallel view of ``accelerator``: an instance of a subclass of its class (``DataParallelView`` first)
    sharing its state (``__dict__``), so every method and attribute is the accelerator's but the process counts,
    ``gather`` and ``reduce``. ``accelerator`` itself is unchanged."""
    base = type(accelerator)
    if base not in _VIEW_CLASSES:
        _VIEW_CLASSES[base] = type(
            f"DataParallelView{base.__name__}", (DataParallelView, base), {"__slots__": ("_sp_topology",)}
        )
    view = object.__new__(_VIEW_CLASSES[base])
    view.__dict__ = accelerator.__dict__
    view._sp_topology = topo
    return view


def check_accelerates(name: str, fn) -> None:
    """TRL's module calls accelerate's own ``gather`` (the whole world's tensors, concatenated in rank order) or
    ``gather_object`` (every rank's items, in rank order), which the entry calls before keeping one copy per SP
    group."""
    import accelerate.utils

    if fn is not getattr(accelerate.utils, name):
        raise ValueError(f"TRL's {name} is {fn!r}, not accelerate.utils.{name}")


def _view_entry(keep_view_share, original):
    """``original`` (accelerate's gather), then, while a data-parallel view is active, ``keep_view_share`` of what it
    gathered: one copy per SP group."""

    @functools.wraps(original)
    def entry(value):
        full = original(value)
        return keep_view_share(full, _DP_VIEWS[-1]) if _DP_VIEWS else full

    return entry


def patch_trl_gathers(module) -> None:
    """Swap ``gather`` / ``gather_object`` of TRL's trainer ``module`` (once) for the data-parallel view's entries."""
    reason = "TRL's online-RL step code sees one copy per SP group while the trainer's data-parallel view is active"
    for name, keep_view_share in (("gather", _dp_rows), ("gather_object", _dp_items)):
        patches.patch(
            module,
            name,
            wrap=functools.partial(_view_entry, keep_view_share),
            check=functools.partial(check_accelerates, name),
            reason=reason,
            fix="Use the tested TRL, or sp_size=1.",
        )
