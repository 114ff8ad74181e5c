"""``SPRewardTrainer``: TRL's ``RewardTrainer`` with sequence parallelism (the same mixin as ``SPTrainer``)."""

from __future__ import annotations

from dataclasses import dataclass

import trl

from ..memory import MemoryArguments
from .arguments import SequenceParallelArguments
from .scoring.hooks import RewardHooks
from .scoring.mixin import PreferenceSPMixin


@dataclass
class RewardConfig(SequenceParallelArguments, MemoryArguments, trl.RewardConfig):
    """``trl.RewardConfig`` plus the sequence-parallel and memory-stack fields."""

    def __post_init__(self):
        super().__post_init__()
        self._check_sequence_parallel()


class SPRewardTrainer(PreferenceSPMixin, trl.RewardTrainer):
    """``trl.RewardTrainer`` with sequence parallelism over ``args.sp_size`` ranks.

    The sequence-classification model runs on sequence shards; the score of each sequence is read at its last
    non-pad token on whichever rank holds it and summed over the SP group with autograd, so loss, gradients, the
    reward / accuracy / margin metrics and predictions equal the single-process ``RewardTrainer`` ones. With
    ``sp_size=1`` it is exactly ``RewardTrainer``.
    """

    sp_hooks_cls = RewardHooks
