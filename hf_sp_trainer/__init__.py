"""hf_sp_trainer: exact Ulysses sequence parallelism for the Hugging Face Trainer."""

from .arguments import SequenceParallelArguments, TrainingArguments
from .attention import ULYSSES_KEY, UlyssesAttention
from .collators import SPDataCollator
from .sft import SFTConfig, SPSFTTrainer
from .trainer import SequenceParallelMixin, SPTrainer

__version__ = "0.1.0"

__all__ = [
    "ULYSSES_KEY",
    "SFTConfig",
    "SPDataCollator",
    "SPSFTTrainer",
    "SPTrainer",
    "SequenceParallelArguments",
    "SequenceParallelMixin",
    "TrainingArguments",
    "UlyssesAttention",
]
