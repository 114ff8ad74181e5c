"""``SPDPOTrainer``: TRL's ``DPOTrainer`` with sequence parallelism (the same mixin as ``SPTrainer``)."""

from __future__ import annotations

from dataclasses import dataclass

import trl

from .arguments import SequenceParallelArguments
from .memory import MemoryArguments
from .preference.mixin import PreferenceSPMixin, refuse


@dataclass
class DPOConfig(SequenceParallelArguments, MemoryArguments, trl.DPOConfig):
    """``trl.DPOConfig`` plus the sequence-parallel and memory-stack fields."""

    def __post_init__(self):
        super().__post_init__()
        if self.sp_size > 1:
            refuse(
                {"precompute_ref_log_probs": self.precompute_ref_log_probs},
                "TRL precomputes the reference log-probs with unsharded forwards inside the trainer's constructor",
                "Set precompute_ref_log_probs=False (the reference then runs sharded, without gradients, each step).",
            )
        self._check_sequence_parallel()


class SPDPOTrainer(PreferenceSPMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` with sequence parallelism over ``args.sp_size`` ranks.

    Policy and reference (a ``ref_model``, TRL's copy of the policy, or the adapter-disabled policy with LoRA) run on
    sequence shards; per-token log-probs are summed over the SP group with autograd, so every DPO loss type, the
    ``ld_alpha`` and WPO variants, the loss, gradients and every logged metric equal the single-process
    ``DPOTrainer`` ones. With ``sp_size=1`` it is exactly ``DPOTrainer``.
    """
