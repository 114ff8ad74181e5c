"""``TrainingArguments`` with sequence-parallel fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import transformers

from ..integrations import cpu_backend
from ..integrations.accelerate_sp import apply_to_args, route_accelerate_sp
from ..memory import MemoryArguments
from ..mixers.swap import STATE_PASSING, check_state_passing
from ..topology import check_ring_size, check_world
from .auto_sp import AUTO, parse_sp_size


@dataclass
class SequenceParallelArguments:
    """The SP fields, shared by ``TrainingArguments`` and the TRL configs."""

    sp_size: int | str = field(
        default=1,
        metadata={
            "help": "Sequence-parallel size: each sequence is split over this many ranks (world = dp x sp), as "
            "ulysses x ring. 1 disables sequence parallelism. 'auto': the trainer picks the smallest sp whose "
            "predicted peak fits the device memory (checkpoint_memory_budget if set), from the model, the longest "
            "row (max_length, else the train dataset's) and the world size, and logs it; ValueError if none fits."
        },
    )
    sp_ring_size: int | None = field(
        default=None,
        metadata={
            "help": "Ring size of the ulysses x ring split of sp_size. Default: the largest Ulysses degree dividing "
            "both sp_size and the model's query heads, the rest a ring. Ulysses groups are contiguous ranks."
        },
    )
    sp_attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention kernel run inside SP: sdpa, eager, flex_attention, flash_attention_2/3 or any key "
            "registered in transformers.AttentionInterface (with a ring: sdpa, eager or flash_attention_2/3). "
            "Default: the model's own attention implementation."
        },
    )
    sp_split_media: bool = field(
        default=False,
        metadata={
            "help": "Vision-language models: split the batch's images / videos over the SP ranks (each encodes a "
            "group, the features are exchanged with one all-gather) instead of every rank encoding all of them. "
            "Pays for a trained vision tower on image-heavy rows. Qwen-VL, GLM-4V, LLaVA-style and Gemma3 layouts; a "
            "long video of Qwen-VL / GLM-4V is split by frame. No effect on text-only models."
        },
    )
    sp_state_passing: str = field(
        default="gather",
        metadata={
            "help": "How hybrid layers (Gated DeltaNet, KDA, Mamba2) carry their recurrent state across SP ranks: "
            "'gather' (default: every rank's run summary all-gathered once per layer, the ranks run in parallel) or "
            "'relay' (a debugging aid: the state handed rank to rank in sequence, as one device computes it; with "
            "runs aligned to the kernel's chunks, Gated DeltaNet's result is bitwise the single-device one).",
            "choices": list(STATE_PASSING),
        },
    )

    sp_throughput_logging: bool = field(
        default=True,
        metadata={
            "help": "With sp_size > 1, add tokens_per_second_per_rank, step_time_s, peak_memory_mb and (CUDA) mfu to "
            "the training logs (hf_sp_trainer.throughput.ThroughputCallback). False: the logs are unchanged."
        },
    )

    @cached_property
    def _setup_devices(self):
        cpu_backend.bring_up(self)  # FSDP2 / DeepSpeed over gloo on a CPU-only machine; else nothing
        return super()._setup_devices

    def _check_sequence_parallel(self) -> None:
        # ParallelismConfig(sp_size=...) / PARALLELISM_CONFIG_SP_SIZE: this config's fields only; the environment is
        # rewritten when the trainer builds its Accelerator (SequenceParallelMixin.create_accelerator_and_postprocess)
        self.sp_size = parse_sp_size(self.sp_size)
        apply_to_args(self, route_accelerate_sp(self))
        check_state_passing(self.sp_state_passing)
        if self.sp_size == AUTO:  # the trainer resolves it (trainers/auto_sp.py): it has the model and the rows
            if self.sp_ring_size is not None:
                raise ValueError(
                    f"sp_ring_size={self.sp_ring_size} with sp_size='auto': the planner picks the ring with sp (the "
                    "default split). Set sp_size to an integer to fix the ring, or leave sp_ring_size unset."
                )
            return
        check_world(self.sp_size, self.world_size if self.sp_size > 1 else 1)
        check_ring_size(self.sp_size, self.sp_ring_size)


@dataclass
class TrainingArguments(SequenceParallelArguments, MemoryArguments, transformers.TrainingArguments):
    """``transformers.TrainingArguments`` plus the sequence-parallel and memory-stack fields."""

    def __post_init__(self):
        super().__post_init__()
        self._check_sequence_parallel()
