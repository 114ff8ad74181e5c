"""The batch layout under sequence parallelism (``sequence``: shift labels -> pad -> zigzag -> slice, and back), the
ring's zigzag plan of causal blocks (``zigzag``) and the image blocks a VLM's tokens attend (``image_blocks``).
Needs only torch."""

from .sequence import (
    IGNORE_INDEX,
    MEDIA_KEYS,
    SequenceSharding,
    add_position_ids,
    add_shift_labels,
    check_no_padding_mask,
    check_sp_padding,
    pad_to_multiple,
    sequence_length,
    shift_labels,
)

__all__ = [
    "IGNORE_INDEX",
    "MEDIA_KEYS",
    "SequenceSharding",
    "add_position_ids",
    "add_shift_labels",
    "check_no_padding_mask",
    "check_sp_padding",
    "pad_to_multiple",
    "sequence_length",
    "shift_labels",
]
