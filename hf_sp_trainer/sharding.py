"""Split a batch along the sequence for one rank of an SP group.

Order matters: ``shift_labels`` are computed on the full sequence *before* sharding (so the last token of a shard
still predicts the first token of the next one), then the sequence is padded to a multiple of ``sp_size`` with
tokens no real token attends to and whose labels are ``-100``, then every rank keeps its contiguous slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
_LABEL_KEYS = ("labels", "shift_labels")


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


def add_position_ids(batch: dict[str, Any]) -> dict[str, Any]:
    if batch.get("position_ids") is not None:
        return batch
    ref = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    position_ids = torch.arange(ref.shape[1], device=ref.device).expand(ref.shape[0], -1)
    return {**batch, "position_ids": position_ids}


def add_shift_labels(batch: dict[str, Any]) -> dict[str, Any]:
    """``shift_labels[t] = labels[t + 1]``, ``-100`` at the end of each row (what causal-LM losses compute)."""
    if batch.get("labels") is None or batch.get("shift_labels") is not None:
        return batch
    shift = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    return {**batch, "shift_labels": shift}


def pad_to_multiple(batch: dict[str, Any], multiple: int, pad_token_id: int = 0) -> dict[str, Any]:
    """Pad every sequence tensor to a length divisible by ``multiple``.

    Padding gets ``position_ids`` 0, 1, 2, ... (a document of its own, never attended by real tokens), labels
    ``-100``, token ``pad_token_id`` and zeros elsewhere.
    """
    length = sequence_length(batch)
    extra = -length % multiple
    if extra == 0:
        return batch
    out = {}
    for key, value in batch.items():
        if not _is_sequence_tensor(value, length):
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


def shard_sequence(batch: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Keep slice ``rank`` of ``world`` equal slices of every sequence tensor (length must divide by ``world``)."""
    length = sequence_length(batch)
    if length % world:
        raise ValueError(f"Sequence length {length} is not a multiple of sp_size={world}; pad it first.")
    size = length // world
    return {
        key: value[:, rank * size : (rank + 1) * size] if _is_sequence_tensor(value, length) else value
        for key, value in batch.items()
    }


def prepare_sp_batch(batch: dict[str, Any], sp_rank: int, sp_size: int, pad_token_id: int = 0) -> dict[str, Any]:
    """The full batch every rank of an SP group holds -> this rank's shard (checks, shift labels, pad, slice)."""
    batch = check_no_padding_mask(batch)
    batch = add_position_ids(batch)
    batch = add_shift_labels(batch)
    batch = pad_to_multiple(batch, sp_size, pad_token_id)
    return shard_sequence(batch, sp_rank, sp_size)


def _is_sequence_tensor(value: Any, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == length
