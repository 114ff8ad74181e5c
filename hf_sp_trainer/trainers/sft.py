"""``SPSFTTrainer``: TRL's ``SFTTrainer`` with sequence parallelism (the same mixin as ``SPTrainer``)."""

from __future__ import annotations

from dataclasses import dataclass

import trl
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling, DataCollatorForVisionLanguageModeling

from ..collators.multimodal import SPMultimodalCollator, SPVisionSFTCollator
from ..memory import MemoryArguments
from ..model.decoder import unwrap_peft
from .arguments import SequenceParallelArguments
from .base import SequenceParallelMixin


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

    def sp_loss_scaled_by_world(self) -> bool:
        return bool(self.args.average_tokens_across_devices)  # TRL scales whenever it is given num_items_in_batch

    def sp_default_collator(self, processing_class):
        return None  # TRL's own collator, made padding-free in sp_after_init

    def sp_after_init(self) -> None:
        collator = self.data_collator
        if isinstance(collator, DataCollatorForLanguageModeling):
            # One flat row per batch. Not through args.padding_free: TRL would then skip truncating at max_length.
            collator.padding_free = True
        elif isinstance(collator, DataCollatorForVisionLanguageModeling):
            # TRL's processing per example, then one packed row (TRL itself refuses packing for vision datasets)
            packer = SPMultimodalCollator(unwrap_peft(self.model))
            self.data_collator = SPVisionSFTCollator(collator, packer)
        elif self._is_vision_dataset:
            raise ValueError(
                f"Sequence parallelism (sp_size > 1) with a vision dataset needs TRL's vision collator; got "
                f"{type(collator).__name__}."
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss; under SP with the MoE router loss on, TRL's shard-local aux term is replaced by the exact one.

        TRL adds ``coef * aux / steps`` without the data-parallel ``x world`` factor of its token loss; each rank adds
        ``sp_size x`` its share instead (so DDP's mean over the SP group adds the whole sequence's term once) and
        logs the whole sequence's value. In evaluation the SP loss is already summed over the group: the value is
        added once, as TRL does on one process.
        """
        router_loss = self.sp.router_loss if self.sp is not None else None
        if router_loss is None or not self.aux_loss_enabled:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.aux_loss_enabled = False  # TRL neither adds nor logs it (the model still computes it: config)
        try:
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.aux_loss_enabled = True
        loss, outputs = result if return_outputs else (result, None)
        recorded = router_loss.take()
        if recorded is None:
            raise RuntimeError("The MoE router loss was enabled but the model's forward did not compute it.")
        share, value = recorded
        if model.training:
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.sp.topology.sp_size * self.router_aux_loss_coef * share / steps
        else:
            loss = loss + self.router_aux_loss_coef * value
        mode = "train" if model.training else "eval"
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(value.detach()).mean().item())
        return (loss, outputs) if return_outputs else loss
