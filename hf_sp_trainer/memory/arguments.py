"""The memory-stack fields, shared by ``TrainingArguments`` and ``SFTConfig`` (each numerically exact on or off)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

# Our flag's former name, which TRL's configs also define (TRL's own offloading, which needs an accelerator): on our
# configs and in the SP trainers it means checkpoint_offloading (with a FutureWarning), as it always did.
DEPRECATED_ALIASES = {"activation_offloading": "checkpoint_offloading"}


def resolve_deprecated_flags(args) -> None:
    """Move a deprecated flag set on ``args`` to its new name (a FutureWarning naming it) and switch the old one off,
    so that a base trainer defining a flag of that name (TRL's ``activation_offloading``) never acts on it."""
    for old, new in DEPRECATED_ALIASES.items():
        if getattr(args, old, False):
            warnings.warn(
                f"{old}=True on a hf_sp_trainer config or trainer means {new}=True (hf_sp_trainer's offloading of "
                f"the activations saved by checkpointing; TRL's own {old} is not used): set {new} instead, {old} "
                "will be removed.",
                FutureWarning,
                stacklevel=3,
            )
            setattr(args, new, True)
            setattr(args, old, False)


@dataclass
class MemoryArguments:
    """Long-context memory features; each is exact (same loss, gradients and weights) whether on or off."""

    tiled_mlp: bool = field(
        default=False,
        metadata={
            "help": "Run every decoder MLP over sequence tiles and recompute each tile in backward, so only one "
            "tile's intermediate activations live at a time. Dense gated MLPs (Llama, Qwen2/3, Mistral, Gemma3, "
            "Phi3); other models raise a ValueError."
        },
    )
    tiled_mlp_num_shards: int | None = field(
        default=None,
        metadata={
            "help": "Number of sequence tiles per MLP call with --tiled_mlp. Default: "
            "ceil(local tokens / max(hidden, 1024))."
        },
    )
    fused_loss: bool = field(
        default=False,
        metadata={
            "help": "Compute the LM-head projection and cross-entropy in chunks, never materialising the full "
            "[seq, vocab] logits (Liger's fused linear cross-entropy when liger-kernel and a GPU are present). "
            "Used when no logits are returned (training, loss-only evaluation). With SFTConfig it is a no-op: "
            "TRL's nll/dft loss already uses a fused LM head."
        },
    )
    checkpoint_offloading: bool = field(
        default=False,
        metadata={
            "help": "Move the hidden states saved by activation (gradient) checkpointing to host memory, "
            "asynchronously with pinned buffers on GPU. A no-op with a warning on CPU. Needs activation "
            "checkpointing (ValueError otherwise). Formerly activation_offloading (a deprecated alias)."
        },
    )
    activation_offloading: bool = field(
        default=False,
        metadata={
            "help": "Deprecated alias of checkpoint_offloading (a FutureWarning). TRL's configs have their own flag of "
            "this name (TRL's offloading of every saved activation); the SP trainers route it to "
            "checkpoint_offloading instead."
        },
    )
    checkpoint_policy: str = field(
        default="full",
        metadata={
            "help": "With activation (gradient) checkpointing: 'full' recomputes each decoder layer in backward; "
            "'sequence_aware' saves the attention kernels' outputs (O(seq^2) to recompute) and recomputes the rest, "
            "the Ulysses all-to-alls included; 'auto' keeps what 'sequence_aware' keeps in as many layers as "
            "checkpoint_memory_budget allows, forward by forward (the first two steps run as 'full' and measure "
            "the memory). Non-reentrant checkpointing only (ValueError otherwise).",
            "choices": ["full", "sequence_aware", "auto"],
        },
    )
    checkpoint_memory_budget: float | None = field(
        default=None,
        metadata={
            "help": "With checkpoint_policy='auto' or sp_size='auto': the memory one rank may use, in bytes (> 1), or "
            "as a fraction of the CUDA device's memory (<= 1). Needed by checkpoint_policy='auto'; sp_size='auto' "
            "takes the device's memory without it. Ignored otherwise."
        },
    )

    def __post_init__(self):
        resolve_deprecated_flags(self)  # before the base config's own post-init (TRL's) sees the old name
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
