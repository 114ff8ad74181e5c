"""The one owner of the batch layout under sequence parallelism: shift labels -> pad -> zigzag -> slice, and back.

Every rank of an SP group holds the same (packed) batch. ``SequenceSharding.shard_batch`` turns it into this rank's
shard, in this order:

1. checks: no padding zeros in an ``attention_mask`` (SP needs ``position_ids`` packing), ``position_ids`` added;
2. ``shift_labels`` on the full sequence, so the last token of a shard still predicts the first token of the next;
3. padding to a multiple of ``sp_size`` (``2 x sp_size`` with a ring): a document of its own (``position_ids`` 0, 1,
   ...), labels ``-100``, never attended by real tokens, and marked by an ``attention_mask`` (0 on the padding) for
   what counts tokens (the MoE router loss, as transformers excludes padding from it);
4. with a ring of ``R`` ranks, the zigzag order: the sequence is cut into ``2R`` chunks and ring rank ``i`` takes
   chunks ``i`` and ``2R-1-i`` (causal work balanced over the ring);
5. equal contiguous slices of that order, one per SP rank (``sp_rank = ring_rank x ulysses + ulysses_rank``).

``unshard`` is the inverse for tensors gathered over the SP group (evaluation logits and labels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
_LABEL_KEYS = ("labels", "shift_labels")
# Media inputs of vision-language models: every rank holds them whole (multimodal.features encodes them), whatever
# their shapes happen to be; the multimodal collator concatenates them per example, in token order.
MEDIA_KEYS = (
    *("pixel_values", "image_grid_thw", "image_sizes", "spatial_shapes", "pixel_attention_mask"),
    *("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"),
    "batch_num_images",  # LLaVA-OneVision: images per example (several skip the tiles), one entry per document
    *("image_position_ids", "video_position_ids", "num_frames_per_video"),  # Gemma4: patch (x, y), -1 = padding
)


def sequence_length(batch: dict[str, Any]) -> int:
    tokens = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    return tokens.shape[1]


def check_no_padding_mask(batch: dict[str, Any]) -> dict[str, Any]:
    """Drop an all-ones ``attention_mask``; refuse one with padding zeros (SP needs ``position_ids`` packing)."""
    mask = batch.get("attention_mask")
    if mask is None:
        return batch
    if not bool(mask.bool().all()):
        raise ValueError(
            f"The batch has an attention_mask with {int((mask == 0).sum())} padding zeros (shape "
            f"{list(mask.shape)}); sequence parallelism needs padding-free batches. Pack examples with position_ids "
            "(hf_sp_trainer.SPDataCollator, the default of SPTrainer) instead of padding them."
        )
    return {k: v for k, v in batch.items() if k != "attention_mask"}


def check_sp_padding(position_ids: torch.Tensor, mask: torch.Tensor, multiple: int) -> None:
    """Refuse an ``attention_mask`` (of the full, unsharded sequence) whose zeros are not ``pad_to_multiple``'s: fewer
    than ``multiple`` trailing tokens of every row, numbered 0, 1, ... (a document of their own)."""
    length = mask.shape[-1]
    zeros = mask == 0
    count = zeros.sum(dim=-1, keepdim=True)
    index = torch.arange(length, device=mask.device)
    trailing = index >= length - count
    sp_padding = (
        bool((zeros == trailing).all())
        and bool((count < multiple).all())
        and bool((position_ids[zeros] == (index - (length - count))[zeros]).all())
    )
    if not sp_padding:
        raise ValueError(
            f"An attention_mask with {int(zeros.sum())} padding zeros (shape {list(mask.shape)}) was passed under "
            "sequence parallelism; padded batches are not supported. Pack examples with position_ids instead "
            "(hf_sp_trainer.SPDataCollator)."
        )


def add_position_ids(batch: dict[str, Any]) -> dict[str, Any]:
    if batch.get("position_ids") is not None:
        return batch
    ref = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    position_ids = torch.arange(ref.shape[1], device=ref.device).expand(ref.shape[0], -1)
    return {**batch, "position_ids": position_ids}


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``shift_labels[t] = labels[t + 1]``, ``-100`` at the end of each row (what causal-LM losses compute)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def add_shift_labels(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with ``shift_labels`` from its ``labels`` (on the whole rows, before any split)."""
    if batch.get("labels") is None or batch.get("shift_labels") is not None:
        return batch
    return {**batch, "shift_labels": shift_labels(batch["labels"])}


def pad_to_multiple(batch: dict[str, Any], multiple: int, pad_token_id: int = 0) -> dict[str, Any]:
    """Pad every sequence tensor to a length divisible by ``multiple``.

    Padding gets ``position_ids`` 0, 1, 2, ... (a document of its own, never attended by real tokens), labels
    ``-100``, token ``pad_token_id``, ``attention_mask`` 0 (1 on the real tokens) and zeros elsewhere.
    """
    length = sequence_length(batch)
    extra = -length % multiple
    if extra == 0:
        return batch
    if batch.get("attention_mask") is None:
        ref = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
        batch = {**batch, "attention_mask": torch.ones(ref.shape[:2], dtype=torch.long, device=ref.device)}
    out = {}
    for key, value in batch.items():
        if _is_rope_positions(key, value, length):  # [4, b, s]: every row numbers the padding 0, 1, ...
            pad = torch.arange(extra, device=value.device, dtype=value.dtype).expand(*value.shape[:2], extra)
            out[key] = torch.cat([value, pad], dim=-1)
            continue
        if not _is_sequence_tensor(value, length, key):
            out[key] = value
            continue
        pad_shape = (value.shape[0], extra, *value.shape[2:])
        if key == "position_ids":
            pad = torch.arange(extra, device=value.device, dtype=value.dtype).expand(pad_shape)
        else:
            fill = IGNORE_INDEX if key in _LABEL_KEYS else pad_token_id if key == "input_ids" else 0
            pad = torch.full(pad_shape, fill, dtype=value.dtype, device=value.device)
        out[key] = torch.cat([value, pad], dim=1)
    return out


@dataclass(frozen=True)
class SequenceSharding:
    """Which positions of a sequence each rank of an SP group of ``sp_size = ulysses x ring_size`` ranks holds."""

    sp_size: int
    ring_size: int = 1

    @property
    def multiple(self) -> int:
        """Sequence lengths are padded to a multiple of this: equal shards (and ``2 x ring`` zigzag chunks)."""
        return self.sp_size * (2 if self.ring_size > 1 else 1)

    def order(self, length: int) -> torch.Tensor | None:
        """Global position of each position of the SP-rank-major concatenated shards; None: the identity."""
        if self.ring_size == 1:
            return None
        from .zigzag import zigzag_permutation

        return zigzag_permutation(length, self.ring_size)

    def positions(self, length: int, sp_rank: int) -> torch.Tensor:
        """The global positions held by ``sp_rank`` for a (padded) sequence of ``length`` tokens, in order."""
        size = length // self.sp_size
        order = self.order(length)
        local = torch.arange(sp_rank * size, (sp_rank + 1) * size)
        return local if order is None else order[local]

    def shard(self, batch: dict[str, Any], sp_rank: int) -> dict[str, Any]:
        """This rank's slice of every sequence tensor (the length must be a multiple of ``self.multiple``)."""
        length = sequence_length(batch)
        if length % self.multiple:
            raise ValueError(f"Sequence length {length} is not a multiple of {self.multiple}; pad it first.")
        index = self.positions(length, sp_rank)
        start, size = int(index[0]), len(index)
        contiguous = bool((index == torch.arange(start, start + size)).all())
        out = {}
        for key, value in batch.items():
            if _is_rope_positions(key, value, length):  # [4, b, s]: sharded along the sequence, the last dim
                out[key] = _take(value.movedim(-1, 1), index, start, size, contiguous).movedim(1, -1)
            elif _is_sequence_tensor(value, length, key):
                out[key] = _take(value, index, start, size, contiguous)
            else:
                out[key] = value
        return out

    def shard_batch(self, batch: dict[str, Any], sp_rank: int, pad_token_id: int = 0) -> dict[str, Any]:
        """The full batch every rank of the SP group holds -> this rank's shard (checks, shift, pad, zigzag, slice)."""
        batch = check_no_padding_mask(batch)
        batch = add_position_ids(batch)
        batch = add_shift_labels(batch)
        batch = pad_to_multiple(batch, self.multiple, pad_token_id)
        return self.shard(batch, sp_rank)

    def unshard(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Shards concatenated in SP-rank order along ``dim`` -> the original (padded) sequence order."""
        order = self.order(gathered.shape[dim])
        if order is None:
            return gathered
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return gathered.index_select(dim, inverse.to(gathered.device))


def _take(value: torch.Tensor, index: torch.Tensor, start: int, size: int, contiguous: bool) -> torch.Tensor:
    if contiguous:
        return value[:, start : start + size]
    return value.index_select(1, index.to(value.device))


def _is_sequence_tensor(value: Any, length: int, key: str = "") -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == length and key not in MEDIA_KEYS


def _is_rope_positions(key: str, value: Any, length: int) -> bool:
    """Multimodal rotary ``position_ids`` ``[rows, b, s]`` (Qwen-VL's text row then t / h / w)."""
    return key == "position_ids" and isinstance(value, torch.Tensor) and value.ndim == 3 and value.shape[-1] == length
