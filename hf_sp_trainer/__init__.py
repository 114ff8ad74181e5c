"""hf_sp_trainer: exact sequence parallelism (Ulysses x Ring) for the Hugging Face Trainer and TRL.

Imports are lazy: ``import hf_sp_trainer`` loads nothing heavy; TRL, PEFT and datasets are imported when a TRL
trainer or config is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "DPOConfig": "trainers.dpo",
    "GRPOConfig": "trainers.grpo",
    "RLOOConfig": "trainers.grpo",
    "SPGRPOTrainer": "trainers.grpo",
    "SPRLOOTrainer": "trainers.grpo",
    "KTOConfig": "trainers.kto",
    "RewardConfig": "trainers.reward",
    "SPDPOTrainer": "trainers.dpo",
    "SPKTOTrainer": "trainers.kto",
    "SPRewardTrainer": "trainers.reward",
    "SequenceParallelArguments": "trainers.arguments",
    "TrainingArguments": "trainers.arguments",
    "ULYSSES_KEY": "attention.ulysses",
    "UlyssesAttention": "attention.ulysses",
    "SPDataCollator": "collators",
    "SPMultimodalCollator": "collators",
    "SequenceParallel": "parallel",
    "apply_sequence_parallel": "parallel",
    "SFTConfig": "trainers.sft",
    "SPSFTTrainer": "trainers.sft",
    "SPTrainer": "trainers.base",
    "SequenceParallelMixin": "trainers.base",
    "ThroughputCallback": "integrations.throughput",
    "add_throughput_callback": "integrations.throughput",
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
    from .attention.ulysses import ULYSSES_KEY, UlyssesAttention
    from .collators import SPDataCollator, SPMultimodalCollator
    from .integrations.throughput import ThroughputCallback, add_throughput_callback
    from .parallel import SequenceParallel, apply_sequence_parallel
    from .trainers.arguments import SequenceParallelArguments, TrainingArguments
    from .trainers.base import SequenceParallelMixin, SPTrainer
    from .trainers.dpo import DPOConfig, SPDPOTrainer
    from .trainers.grpo import GRPOConfig, RLOOConfig, SPGRPOTrainer, SPRLOOTrainer
    from .trainers.kto import KTOConfig, SPKTOTrainer
    from .trainers.reward import RewardConfig, SPRewardTrainer
    from .trainers.sft import SFTConfig, SPSFTTrainer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_sp_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
