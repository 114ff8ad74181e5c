"""hf_sp_trainer: exact sequence parallelism (Ulysses x Ring) for the Hugging Face Trainer and TRL.

Imports are lazy: ``import hf_sp_trainer`` loads nothing heavy; TRL, PEFT and datasets are imported when a TRL
trainer or config is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "DPOConfig": "dpo",
    "GRPOConfig": "grpo",
    "RLOOConfig": "grpo",
    "SPGRPOTrainer": "grpo",
    "SPRLOOTrainer": "grpo",
    "KTOConfig": "kto",
    "RewardConfig": "reward",
    "SPDPOTrainer": "dpo",
    "SPKTOTrainer": "kto",
    "SPRewardTrainer": "reward",
    "SequenceParallelArguments": "arguments",
    "TrainingArguments": "arguments",
    "ULYSSES_KEY": "attention.ulysses",
    "UlyssesAttention": "attention.ulysses",
    "SPDataCollator": "collators",
    "SPMultimodalCollator": "collators",
    "SequenceParallel": "parallel",
    "apply_sequence_parallel": "parallel",
    "SFTConfig": "sft",
    "SPSFTTrainer": "sft",
    "SPTrainer": "trainer",
    "SequenceParallelMixin": "trainer",
    "ThroughputCallback": "throughput",
    "add_throughput_callback": "throughput",
}
__all__ = [
    "DPOConfig",
    "GRPOConfig",
    "RLOOConfig",
    "SPGRPOTrainer",
    "SPRLOOTrainer",
    "KTOConfig",
    "RewardConfig",
    "SPDPOTrainer",
    "SPKTOTrainer",
    "SPRewardTrainer",
    "SFTConfig",
    "SPDataCollator",
    "SPMultimodalCollator",
    "SPSFTTrainer",
    "SPTrainer",
    "SequenceParallel",
    "SequenceParallelArguments",
    "SequenceParallelMixin",
    "ThroughputCallback",
    "TrainingArguments",
    "ULYSSES_KEY",
    "UlyssesAttention",
    "add_throughput_callback",
    "apply_sequence_parallel",
]

if TYPE_CHECKING:
    from .arguments import SequenceParallelArguments, TrainingArguments
    from .attention.ulysses import ULYSSES_KEY, UlyssesAttention
    from .collators import SPDataCollator, SPMultimodalCollator
    from .dpo import DPOConfig, SPDPOTrainer
    from .grpo import GRPOConfig, RLOOConfig, SPGRPOTrainer, SPRLOOTrainer
    from .kto import KTOConfig, SPKTOTrainer
    from .parallel import SequenceParallel, apply_sequence_parallel
    from .reward import RewardConfig, SPRewardTrainer
    from .sft import SFTConfig, SPSFTTrainer
    from .throughput import ThroughputCallback, add_throughput_callback
    from .trainer import SequenceParallelMixin, SPTrainer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_sp_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
