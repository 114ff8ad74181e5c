"""``SPKTOTrainer``: TRL's ``KTOTrainer`` with sequence parallelism (the same mixin as ``SPTrainer``)."""

from __future__ import annotations

from dataclasses import dataclass

import trl

from ..memory import MemoryArguments
from .arguments import SequenceParallelArguments
from .scoring.mixin import PreferenceSPMixin, refuse_precomputed_reference


@dataclass
class KTOConfig(SequenceParallelArguments, MemoryArguments, trl.KTOConfig):
    """``trl.KTOConfig`` plus the sequence-parallel and memory-stack fields."""

    def __post_init__(self):
        super().__post_init__()
        refuse_precomputed_reference(self)
        self._check_sequence_parallel()


class SPKTOTrainer(PreferenceSPMixin, trl.KTOTrainer):
    """``trl.KTOTrainer`` with sequence parallelism over ``args.sp_size`` ranks.

    Completion and KL (mismatched-pair) log-probs of policy and reference are computed on sequence shards and summed
    over the SP group with autograd: loss, gradients, the KL estimate and the logged metrics equal the single-process
    ``KTOTrainer`` ones. With ``sp_size=1`` it is exactly ``KTOTrainer``.
    """

    sp_vision_data = True  # TRL's vision KTO batches: the hooks pack them like DPO's (a VLM SP supports)
