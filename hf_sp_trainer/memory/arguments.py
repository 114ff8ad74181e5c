"""The memory-stack fields, shared by ``TrainingArguments`` and ``SFTConfig`` (each numerically exact on or off)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    activation_offloading: bool = field(
        default=False,
        metadata={
            "help": "Move the hidden states saved by activation (gradient) checkpointing to host memory, "
            "asynchronously with pinned buffers on GPU. A no-op with a warning on CPU. Needs activation "
            "checkpointing (ValueError otherwise). Replaces TRL's activation offloading in SPSFTTrainer."
        },
    )
    checkpoint_policy: str = field(
        default="full",
        metadata={
            "help": "With activation (gradient) checkpointing: 'full' recomputes each decoder layer in backward; "
            "'sequence_aware' saves the attention outputs and the all-to-all results and recomputes the cheap "
            "O(seq) ops. 'sequence_aware' needs non-reentrant checkpointing (ValueError otherwise).",
            "choices": ["full", "sequence_aware"],
        },
    )
