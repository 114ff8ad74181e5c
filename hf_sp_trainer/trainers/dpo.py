"""``SPDPOTrainer``: TRL's ``DPOTrainer`` with sequence parallelism (the same mixin as ``SPTrainer``)."""

from __future__ import annotations

from dataclasses import dataclass

import trl

from ..memory import MemoryArguments
from .arguments import SequenceParallelArguments
from .scoring.mixin import PreferenceSPMixin, refuse_precomputed_reference


@dataclass
class DPOConfig(SequenceParallelArguments, MemoryArguments, trl.DPOConfig):
    """``trl.DPOConfig`` plus the sequence-parallel and memory-stack fields."""

    def __post_init__(self):
        super().__post_init__()
        refuse_precomputed_reference(self)
        self._check_sequence_parallel()


class SPDPOTrainer(PreferenceSPMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` with sequence parallelism over ``args.sp_size`` ranks.

    Policy and reference (a ``ref_model``, TRL's copy of the policy, or the adapter-disabled policy with LoRA) run on
    sequence shards; per-token log-probs are summed over the SP group with autograd, so every DPO loss type, the
    ``ld_alpha`` and WPO variants, the loss, gradients and every logged metric equal the single-process
    ``DPOTrainer`` ones. With ``sp_size=1`` it is exactly ``DPOTrainer``. On TRL's vision preference data
    (``images`` + ``prompt`` / ``chosen`` / ``rejected``, a processor as ``processing_class``) each rank encodes the
    batch's images and keeps the feature rows of its own placeholders, for VLMs with 1-D positions.
    """

    sp_vision_data = True
