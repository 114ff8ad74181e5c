"""The vision tower of a VLM in the memory model (``planner``), as SP runs it (``multimodal.features``, whole media):
every rank encodes every image of the row, so the tower's activations are per *row*, not per local token.

Per rank, with ``P = image_share x length x merge**2`` patches in the row:

- weights: the tower's parameters (replicated; ZeRO-3: sharded); trained towers add gradients, optimizer states and
  DDP buckets as the decoder's do. A frozen tower (LoRA on the decoder) is encoded under ``no_grad``.
- activations, alive through the decoder's backward (the tower's backward runs last): the row's pixel rows (fp32,
  ``patch_dim`` each) and, for a trained tower, per patch and block ``VISION_SAVED_HIDDEN`` hidden-wide and
  ``VISION_SAVED_MLP`` intermediate-wide tensors (gradient checkpointing: the block's input only). Counted with
  saved-tensor hooks on transformers' Qwen2-VL vision blocks (torch path, sdpa); other towers save about as much
  per patch, which ``scripts/bench_vlm_memory.py`` measures and ``tests/test_planner.py`` compares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

VISION_SAVED_HIDDEN = 14  # two norms (input, normalised), qkv, rotated q and k, the kernel output, proj's input, ...
VISION_SAVED_MLP = 3  # fc1's output, the activation's output and its input to fc2 (x intermediate)


@dataclass(frozen=True)
class VisionShape:
    """What the memory model needs of a VLM's vision tower (and projector)."""

    params: int
    hidden: int
    intermediate: int
    depth: int
    patch_dim: int  # values per patch row of pixel_values
    patches_per_token: int  # patches merged into one placeholder's feature (spatial_merge_size ** 2; LLaVA: 1)

    @classmethod
    def from_config(cls, config, params: int) -> VisionShape | None:
        """``None`` for a text-only config; ``params``: the tower's and projector's parameters (counted on the meta
        device by the caller: towers are too varied to count from the config)."""
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        hidden = getattr(vision, "embed_dim", None) or vision.hidden_size
        intermediate = getattr(vision, "intermediate_size", None)
        if not intermediate or getattr(vision, "embed_dim", None):  # Qwen2-VL: intermediate from mlp_ratio
            intermediate = int(hidden * getattr(vision, "mlp_ratio", 4))
        patch = getattr(vision, "patch_size", 14)
        patch = patch[0] if isinstance(patch, (list, tuple)) else patch
        channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
        merge = getattr(vision, "spatial_merge_size", None) or getattr(config, "spatial_merge_size", None) or 1
        return cls(
            params=params, hidden=hidden, intermediate=intermediate,
            depth=getattr(vision, "depth", None) or vision.num_hidden_layers,
            patch_dim=channels * (getattr(vision, "temporal_patch_size", None) or 1) * patch * patch,
            patches_per_token=merge * merge,
        )  # fmt: skip


def vision_memory(v: VisionShape, length: int, image_share: float, trained: bool, checkpointing: bool, b: int,
                  ranks: int, zero: int, split: int = 1) -> dict[str, float]:  # fmt: skip
    """Per-rank bytes of the tower: ``weights``, ``gradients``, ``optimizer_states``, ``buckets`` (trained only) and
    ``saved`` (the activations alive at the start of the decoder's backward). ``split``: the ranks the images are
    split over (``sp_split_media``; 1: every rank encodes all): the row's pixels stay whole in every rank's batch,
    the tower's saved activations are those of ``1 / split`` of the patches."""
    patches = math.ceil(image_share * length) * v.patches_per_token
    out = {"weights": v.params * b / (ranks if zero == 3 else 1), "saved": patches * v.patch_dim * 4.0}
    if not trained:
        return out | {"gradients": 0.0, "optimizer_states": 0.0, "buckets": 0.0}
    per_block = v.hidden if checkpointing else VISION_SAVED_HIDDEN * v.hidden + VISION_SAVED_MLP * v.intermediate
    out["saved"] += math.ceil(patches / split) * v.depth * per_block * b
    out["gradients"] = v.params * b / (ranks if zero >= 2 else 1)
    out["optimizer_states"] = v.params * (12 if b == 2 else 8) / (ranks if zero >= 1 else 1)
    out["buckets"] = v.params * b if (zero == 0 and ranks > 1) else 0.0
    return out
