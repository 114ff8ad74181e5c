"""The long-context memory stack: tiled MLP, fused chunked loss, checkpoint offload, sequence-aware checkpointing.

Each feature is one ``MemoryArguments`` field; ``enable_memory_features`` applies the enabled ones to a model (with
any ``sp_size``, including 1). Everything happens on the model: the trainers only call this once.
"""

from __future__ import annotations

from torch import nn

from ..losses.fused import loss_only_inputs
from ..model.decoder import unwrap_peft
from .arguments import MemoryArguments, resolve_deprecated_flags


def enable_memory_features(
    model: nn.Module, args, *, lm_loss_fused: bool = False, ring_size: int = 1, ulysses_size: int = 1
) -> None:
    """Apply the memory features switched on in ``args`` to ``model`` (once, after the trainer is built).

    ``lm_loss_fused``: the trainer already computes its LM loss without the full logits (TRL's SFT ``nll``/``dft``), so
    ``fused_loss`` has nothing to do. ``ring_size`` / ``ulysses_size``: the SP topology's (``checkpoint_policy="auto"``
    estimates with them).
    """
    if getattr(args, "fused_loss", False):
        from ..losses.fused import enable_fused_loss, log_fused_by_trainer

        if lm_loss_fused:
            log_fused_by_trainer(args)
        else:
            enable_fused_loss(unwrap_peft(model))
    if getattr(args, "tiled_mlp", False):
        from .tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, args.tiled_mlp_num_shards)
    from .checkpointing import enable_checkpoint_features

    enable_checkpoint_features(model, args, ring_size, ulysses_size)  # checkpoint_policy, checkpoint_offloading


__all__ = ["MemoryArguments", "enable_memory_features", "loss_only_inputs", "resolve_deprecated_flags"]
