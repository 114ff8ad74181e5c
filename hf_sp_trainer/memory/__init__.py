"""The long-context memory stack: tiled MLP, fused chunked loss, checkpoint offload, sequence-aware checkpointing.

Each feature is one ``MemoryArguments`` field; ``enable_memory_features`` applies the enabled ones to a trainer's
model after ``Trainer.__init__`` (with any ``sp_size``, including 1).
"""

from __future__ import annotations

from .arguments import MemoryArguments
from .fused_loss import enable_trainer_fused_loss, fused_loss_inputs


def enable_memory_features(trainer) -> None:
    """Apply the memory features switched on in ``trainer.args`` to ``trainer.model``."""
    # Each feature adds its branch here, importing its module lazily.
    if getattr(trainer.args, "fused_loss", False):
        enable_trainer_fused_loss(trainer)
    if getattr(trainer.args, "tiled_mlp", False):
        from .tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(trainer.model, trainer.args.tiled_mlp_num_shards)
    from .checkpointing import enable_checkpoint_features

    enable_checkpoint_features(trainer.model, trainer.args)  # checkpoint_policy, activation_offloading


__all__ = ["MemoryArguments", "enable_memory_features", "fused_loss_inputs"]
