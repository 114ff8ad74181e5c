"""``SPSFTTrainer``: TRL's ``SFTTrainer`` with sequence parallelism (the same mixin as ``SPTrainer``)."""

from __future__ import annotations

from dataclasses import dataclass

import trl
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from .arguments import SequenceParallelArguments
from .memory import MemoryArguments
from .trainer import SequenceParallelMixin


@dataclass
class SFTConfig(SequenceParallelArguments, MemoryArguments, trl.SFTConfig):
    """``trl.SFTConfig`` plus the sequence-parallel and memory-stack fields.

    The same flags give the same training at any ``sp_size``: documents are truncated at ``max_length`` (or packed)
    exactly as without SP; with ``sp_size > 1`` the collator flattens each batch into one padding-free row (documents
    kept apart by ``position_ids``), which gives the loss of TRL's padded batches.
    """

    def __post_init__(self):
        super().__post_init__()
        self._check_sequence_parallel()


class SPSFTTrainer(SequenceParallelMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with sequence parallelism over ``args.sp_size`` ranks.

    Works with TRL packing (bfd, wrapped), padding-free batches, completion-only and assistant-only loss, chat
    templates, the fused LM-head loss (``nll``, ``dft``) and ``peft_config``; loss, gradients and ``eval_loss`` equal
    the single-process ``SFTTrainer`` ones.
    """

    sp_fuses_lm_loss = True  # TRL's nll/dft loss runs a fused LM head already

    def sp_default_collator(self, processing_class):
        return None  # TRL's own collator, made padding-free in sp_after_init

    def sp_after_init(self) -> None:
        collator = self.data_collator
        if isinstance(collator, DataCollatorForLanguageModeling):
            # One flat row per batch. Not through args.padding_free: TRL would then skip truncating at max_length.
            collator.padding_free = True
        elif self._is_vision_dataset:
            raise ValueError("Sequence parallelism (sp_size > 1) does not support vision datasets yet.")
