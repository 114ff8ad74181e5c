"""Padded preference batches -> one padding-free row, sharded over the SP group, and the way back.

TRL's preference collators pad ``[rows, seq]`` batches on the right. Under SP the real tokens of all rows are laid
end to end in one row (each sequence a document of its own: ``position_ids`` restart at 0), next-token labels are
shifted on the padded rows first (a sequence's last token predicts nothing, whichever rank holds it), and the row is
cut with ``SequenceSharding`` like every other SP batch. ``slots`` say where each of this rank's tokens goes in the
caller's output grid (``-1``: nowhere), so per-token or per-sequence results can be scattered back and summed over the
SP group: padding never enters the model and the results are those of the padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...sharding import SequenceSharding, shift_labels


@dataclass
class PackedShard:
    """This rank's slice of a packed preference batch."""

    inputs: dict[str, torch.Tensor]  # input_ids, position_ids (and shift_labels): [1, local_len]
    slots: torch.Tensor  # [local_len]: index into the flattened output grid, -1 where none
    grid: tuple[int, ...]  # the output grid's shape (e.g. [rows, seq - 1] for per-token log-probs)


def real_token_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, right_padded: bool = True
) -> torch.Tensor:
    """The ``[rows, seq]`` mask of real tokens; refuses anything but right padding (what TRL's collators produce)
    unless ``right_padded=False`` (GRPO/RLOO: left-padded prompt + right-padded completion)."""
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    mask = attention_mask.bool()
    if not right_padded:
        return mask
    lengths = mask.sum(dim=1, keepdim=True)
    if not bool((mask == (torch.arange(mask.shape[1], device=mask.device) < lengths)).all()):
        raise ValueError(
            "Sequence parallelism packs TRL's right-padded preference batches into one padding-free row; this batch "
            "has an attention_mask that is not right padding (left padding or holes). Use TRL's default collator."
        )
    return mask


def pack_and_shard(
    sharding: SequenceSharding,
    sp_rank: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    slots: torch.Tensor,
    grid: tuple[int, ...],
    labels: torch.Tensor | None = None,
    pad_token_id: int = 0,
    column_positions: bool = False,
    token_types: dict[str, torch.Tensor] | None = None,
    rope_positions: torch.Tensor | None = None,
) -> PackedShard:
    """Pack the real tokens of a right-padded ``[rows, seq]`` batch into one row and return ``sp_rank``'s shard.

    ``slots``: ``[rows, seq]`` output-grid index of each token (``-1``: none). ``labels``: next-token labels of the
    padded rows (``-100`` ignored), shifted here before packing and returned as ``shift_labels``.
    ``column_positions``: each token keeps its column index as position (what transformers uses when a padded batch
    is given without ``position_ids``; GRPO/RLOO's left-padded prompts), and any mask is accepted.
    ``token_types``: ``[rows, seq]`` tensors packed like ``input_ids`` (a VLM's ``token_type_ids``).
    ``rope_positions``: a multimodal-rope VLM's ``[3, rows, seq]`` positions of the padded rows (``rope_index``),
    packed behind the text row into ``[4, 1, tokens]`` ``position_ids`` (the text row keeps the sequences apart).
    """
    mask = real_token_mask(input_ids, attention_mask, right_padded=not column_positions)
    if column_positions:
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    else:
        positions = mask.long().cumsum(dim=1) - 1
    packed_positions = positions[mask].unsqueeze(0)
    if rope_positions is not None:
        packed_positions = torch.cat([packed_positions[None], rope_positions[:, mask].unsqueeze(1)])
    batch = {"input_ids": input_ids[mask].unsqueeze(0), "position_ids": packed_positions}
    batch |= {key: value[mask].unsqueeze(0) for key, value in (token_types or {}).items()}
    if labels is not None:
        batch["shift_labels"] = shift_labels(labels)[mask].unsqueeze(0)
    flat_slots = slots[mask]
    shard = sharding.shard_batch(batch, sp_rank, pad_token_id)  # pads to the SP multiple (a document of its own)
    length = shard["input_ids"].shape[1] * sharding.sp_size
    flat_slots = F.pad(flat_slots, (0, length - flat_slots.numel()), value=-1)
    local_slots = flat_slots[sharding.positions(length, sp_rank).to(flat_slots.device)]
    return PackedShard(inputs=shard, slots=local_slots, grid=grid)


def token_slots(rows: int, seq: int, device: torch.device) -> torch.Tensor:
    """Per-token outputs of a causal LM: token ``(n, t)`` predicts ``t + 1`` and goes to ``[n, t]`` of a
    ``[rows, seq - 1]`` grid; the last column predicts nothing."""
    t = torch.arange(seq, device=device)
    slots = torch.arange(rows, device=device)[:, None] * (seq - 1) + t
    return slots.masked_fill(t == seq - 1, -1)


def last_token_slots(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Sequence-classification outputs: row ``n``'s score is read at its rightmost non-pad token (transformers'
    rule), which goes to slot ``n`` of a ``[rows]`` grid."""
    rows, seq = input_ids.shape
    if pad_token_id is None:
        if rows != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        last = torch.full((rows,), seq - 1, device=input_ids.device)
    else:
        index = torch.arange(seq, device=input_ids.device)
        last = (index * (input_ids != pad_token_id)).argmax(-1)
    slots = torch.full_like(input_ids, -1)
    slots[torch.arange(rows, device=input_ids.device), last] = torch.arange(rows, device=input_ids.device)
    return slots


def scatter_to_grid(local: torch.Tensor, slots: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
    """``local`` ``[local_len, ...]`` -> the flattened grid (zeros where this rank holds nothing), differentiable."""
    valid = slots >= 0
    size = 1
    for n in grid:
        size *= n
    out = local.new_zeros((size, *local.shape[1:]))
    return out.index_add(0, slots[valid], local[valid])
