"""``TrainingArguments`` with sequence-parallel fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import transformers

from .backends.accelerate_sp import route_accelerate_sp
from .backends.cpu import bring_up_cpu_state, wants_cpu_backend
from .memory import MemoryArguments
from .topology import check_world


@dataclass
class SequenceParallelArguments:
    """The SP fields, shared by ``TrainingArguments`` and ``SFTConfig``."""

    sp_size: int = field(
        default=1,
        metadata={
            "help": "Ulysses sequence-parallel size: each sequence is split over this many ranks (world = dp x sp). "
            "1 disables sequence parallelism."
        },
    )
    sp_attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention kernel run on the full sequence inside Ulysses SP: sdpa, eager, flex_attention, "
            "flash_attention_2/3 or any key registered in transformers.AttentionInterface. Default: the model's "
            "own attention implementation."
        },
    )

    @cached_property
    def _setup_devices(self):
        backend = wants_cpu_backend(self)
        if backend is not None:  # FSDP2 / DeepSpeed over gloo on a CPU-only machine
            bring_up_cpu_state(self, backend)
        return super()._setup_devices

    def _check_sequence_parallel(self) -> None:
        route_accelerate_sp(self)  # ParallelismConfig(sp_size=...) / PARALLELISM_CONFIG_SP_SIZE
        check_world(self.sp_size, self.world_size if self.sp_size > 1 else 1)


@dataclass
class TrainingArguments(SequenceParallelArguments, MemoryArguments, transformers.TrainingArguments):
    """``transformers.TrainingArguments`` plus the sequence-parallel and memory-stack fields."""

    def __post_init__(self):
        super().__post_init__()
        self._check_sequence_parallel()
