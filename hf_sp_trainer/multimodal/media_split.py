"""Phase 2 of merge-after-slicing: the batch's images / videos split over the SP ranks, their features exchanged.

Phase 1 (``features.MediaFeatures``) has every rank encode every medium of the batch, so the tower's activations are
per row on every rank. With ``split_media`` each rank encodes a contiguous group of the media instead (balanced by
feature rows; every rank gets at least one, or all of them encode everything as in phase 1), and one differentiable
all-gather (``mixers.gather.all_gather_stack``: backward, each rank gets the gradient of its own media's features from
every rank) gives every rank the whole batch's feature rows, from which it keeps its placeholders' rows as before.
The tower's activations and its backward are then ``~1/sp`` per rank; the exchanged features are O(image tokens x
text hidden), small next to the tower's per-patch activations.

Layouts split: flat patch rows with a ``{image,video}_grid_thw`` row per medium (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3.5, GLM-4V: ``t * h * w`` patches, ``/ merge**2`` features each) and one pixel tensor per image with a fixed
number of features (LLaVA, Gemma3). Others are refused with a clear error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..mixers.gather import all_gather_stack
from .parts import PIXELS, feature_rows

PER_IMAGE_BASES = frozenset({"LlavaModel", "Gemma3Model"})  # pixel_values [images, C, H, W], features fixed per image
PER_MEDIUM = {"image": ("image_grid_thw",), "video": ("video_grid_thw", "second_per_grid_ts")}


def balanced_groups(counts: list[int], parts: int) -> list[tuple[int, int]] | None:
    """``parts`` contiguous, non-empty ``[start, end)`` ranges of the items, cut where the running sum of ``counts``
    is nearest ``k / parts`` of the total; ``None`` with fewer items than parts."""
    n = len(counts)
    if n < parts:
        return None
    cum = [0]
    for c in counts:
        cum.append(cum[-1] + c)
    cuts = [0]
    for k in range(1, parts):
        target = cum[-1] * k / parts
        best = min(range(n + 1), key=lambda i: abs(cum[i] - target))
        cuts.append(min(max(best, cuts[-1] + 1), n - (parts - k)))
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def media_layout(base: torch.nn.Module, modality: str, kwargs: dict, placeholders: int) -> tuple[list[int], list[int]]:
    """Per medium of the batch: its pixel rows and its feature rows. Raises a ``ValueError`` (the same on every rank:
    they hold the same batch) for a layout this phase can't split."""
    grid = kwargs.get(f"{modality}_grid_thw")
    pixels = kwargs[PIXELS[modality]]
    name = type(base).__name__
    if grid is not None:
        vision = base.config.vision_config
        merge = getattr(vision, "spatial_merge_size", None) or getattr(base.config, "spatial_merge_size", 2)
        patches = [int(t * h * w) for t, h, w in grid.tolist()]
        return patches, [p // (merge * merge) for p in patches]
    if name in PER_IMAGE_BASES and pixels.ndim == 4 and placeholders % pixels.shape[0] == 0:
        n = pixels.shape[0]
        return [1] * n, [placeholders // n] * n
    raise ValueError(
        f"split_media: {name}'s {modality} inputs (pixel values {tuple(pixels.shape)}) have no layout SP can split "
        "over its ranks (splittable: flat patches with a grid_thw row per medium, as Qwen-VL and GLM-4V, or one "
        f"fixed-size image per pixel tensor, as {', '.join(sorted(PER_IMAGE_BASES))}). Use split_media=False."
    )


def encode_split(encode, base, modality: str, kwargs: dict, placeholders: int, group) -> tuple | None:
    """The whole batch's feature rows ``[N, hidden]``, Qwen3-VL's deepstack levels (each ``[N, hidden]``) and this
    rank's own encoder output, this rank having encoded only its group of the media; ``None`` with fewer media than
    ranks (the caller then encodes them all)."""
    pixel_rows, counts = media_layout(base, modality, kwargs, placeholders)
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    groups = balanced_groups(counts, sp)
    if groups is None:
        return None
    lo, hi = groups[rank]
    key = PIXELS[modality]
    starts = [0]
    for rows in pixel_rows:
        starts.append(starts[-1] + rows)
    mine = dict(kwargs)
    mine[key] = kwargs[key][starts[lo] : starts[hi]]
    for name in PER_MEDIUM[modality]:  # the encoder's per-medium inputs
        if kwargs.get(name) is not None:
            mine[name] = kwargs[name][lo:hi]
    encoded = encode(base, modality, mine)
    levels = [feature_rows(encoded.pooler_output)]
    levels += [feature_rows(level) for level in getattr(encoded, "deepstack_features", None) or []]
    local = torch.stack([x.reshape(-1, x.shape[-1]) for x in levels], 1)  # [rows, 1 + deepstack, hidden]
    if local.shape[0] != sum(counts[lo:hi]):
        raise ValueError(
            f"split_media: {type(base).__name__} encoded {local.shape[0]} feature rows for its {modality}s "
            f"{lo}..{hi - 1}, expected {sum(counts[lo:hi])}; use split_media=False."
        )
    width = max(sum(counts[a:b]) for a, b in groups)
    padded = torch.nn.functional.pad(local, (0, 0, 0, 0, 0, width - local.shape[0]))
    gathered = all_gather_stack(padded, group)  # [sp, width, levels, hidden]
    rows = torch.cat([gathered[r, : sum(counts[a:b])] for r, (a, b) in enumerate(groups)])
    return rows[:, 0], [rows[:, i] for i in range(1, rows.shape[1])], encoded
