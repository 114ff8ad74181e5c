"""``SPSFTTrainer``: TRL's ``SFTTrainer`` with Ulysses sequence parallelism (the same mixin as ``SPTrainer``)."""

from __future__ import annotations

from dataclasses import dataclass

import trl
from transformers.utils import logging

from .arguments import SequenceParallelArguments
from .memory import MemoryArguments
from .trainer import SequenceParallelMixin

logger = logging.get_logger(__name__)


@dataclass
class SFTConfig(SequenceParallelArguments, MemoryArguments, trl.SFTConfig):
    """``trl.SFTConfig`` plus ``sp_size`` and ``sp_attn_implementation``.

    With ``sp_size > 1`` batches are padding-free (``padding_free=True`` is implied): TRL's collator flattens each
    batch into one row whose documents are kept apart by ``position_ids``.
    """

    def __post_init__(self):
        super().__post_init__()
        self._check_sequence_parallel()
        if self.sp_size > 1:
            self.padding_free = True
            if not self.packing and self.max_length is not None:
                logger.warning(
                    f"sp_size={self.sp_size} trains on padding-free rows; without packing, TRL does not apply "
                    f"max_length={self.max_length} to them, so it is set to None (long documents are split over the "
                    "SP ranks instead). Use --packing to chunk documents at max_length."
                )
                self.max_length = None


class SPSFTTrainer(SequenceParallelMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with Ulysses sequence parallelism over ``args.sp_size`` ranks.

    Works with TRL packing (bfd, wrapped), padding-free batches, completion-only and assistant-only loss, chat
    templates, the fused LM-head loss (``nll``, ``dft``) and ``peft_config``; loss, gradients and ``eval_loss`` equal
    the single-process ``SFTTrainer`` ones.
    """

    def __init__(self, model, args=None, *extra, **kwargs):
        # ``activation_offloading`` is ours (``hf_sp_trainer.memory``: the checkpointed hidden states, any device), not
        # TRL's (every saved activation, accelerators only): TRL's __init__ must not see it.
        offload = getattr(args, "activation_offloading", False)
        if offload:
            args.activation_offloading = False
        try:
            super().__init__(model, args, *extra, **kwargs)
        finally:
            if offload:
                args.activation_offloading = True
        self._sp_enable()
