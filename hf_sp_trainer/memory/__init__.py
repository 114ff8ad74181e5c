"""The long-context memory stack: tiled MLP, fused chunked loss, checkpoint offload, sequence-aware checkpointing.

Each feature is one ``MemoryArguments`` field; ``enable_memory_features`` applies the enabled ones to a trainer's
model after ``Trainer.__init__`` (with any ``sp_size``, including 1).
"""

from __future__ import annotations

from .arguments import MemoryArguments


def enable_memory_features(trainer) -> None:
    """Apply the memory features switched on in ``trainer.args`` to ``trainer.model``."""
    # Each feature adds its branch here, importing its module lazily.


__all__ = ["MemoryArguments", "enable_memory_features"]
