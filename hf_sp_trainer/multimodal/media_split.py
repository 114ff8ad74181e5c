"""Split media (merge after slicing): the batch's images / videos split over the SP ranks, their features exchanged.

Whole media (``features.MediaFeatures``, the default) has every rank encode every medium of the batch, so the
tower's activations are per row on every rank. With ``split_media`` each rank encodes a contiguous group of the media
instead (balanced by feature rows; every rank gets at least one, or all of them encode everything as with whole
media), and one differentiable
all-gather (``comm.all_gather_stack``: backward, each rank gets the gradient of its own media's features from
every rank) gives every rank the whole batch's feature rows, from which it keeps its placeholders' rows as before.
The tower's activations and its backward are then ``~1/sp`` per rank; the exchanged features are O(image tokens x
text hidden), small next to the tower's per-patch activations.

Layouts split: flat patch rows with a ``{image,video}_grid_thw`` row per medium (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3.5, GLM-4V: ``t * h * w`` patches, ``/ merge**2`` features each; ERNIE-4.5-VL's videos ``/ 2`` more, their
frames merged in pairs), one pixel tensor per image with a fixed
number of features (``PER_IMAGE_BASES``: LLaVA, Gemma3, InternVL's tiles, ...), Gemma4's rows of padded patches
with their positions (``POSITION_BASES``: an image or a video frame each) and LLaVA-Next's tiled images
(``TILE_BASES``: balanced by tiles, each image's feature rows counted once encoded, one small all-reduce). Others
are refused with a clear error.
The unit of the split is a medium, or for the videos of encoders that attend within each frame (``FRAME_BASES``:
attention segments of ``h * w`` patches per temporal row, positions from ``(h, w)`` alone; Gemma4's frames) a
temporal row of a video: one long video is then split over the ranks too, each rank encoding its frames under a grid
row of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.gather import all_gather_stack
from ..model.vlm import PADDING_POSITION, PIXELS, feature_field, feature_rows, row_newline, temporal_merge

# pixel_values [images (InternVL: tiles), C, H, W], a fixed number of features per image, each encoded alone
PER_IMAGE_BASES = frozenset(
    {
        *("LlavaModel", "Gemma3Model", "VipLlavaModel", "InternVLModel", "QianfanOCRModel"),
        *("AyaVisionModel", "Cohere2VisionModel", "GotOcr2Model"),
        "Llama4ForConditionalGeneration",  # its own base: each tile encoded alone, a fixed number of features per tile
    }
)
PER_MEDIUM = {"image": ("image_grid_thw", "image_sizes"), "video": ("video_grid_thw", "second_per_grid_ts")}
# LLaVA-Next's any-resolution images: pixel_values [images, tiles, 3, h, w] (zero-padded tiles), each image's tiles
# encoded on their own; its feature rows (unpadded, a newline per row) are counted once encoded, balanced by tiles
TILE_BASES = frozenset({"LlavaNextModel", "LlavaNextVideoModel"})
# Gemma4: one pixel row (an image, a video frame) of padded patches per position row, each encoded alone, pooled
# k x k: ``real patches / k**2`` features each; a video's frames are units of their own (``num_frames_per_video``)
POSITION_BASES = frozenset({"Gemma4Model"})
PER_PIXEL_ROW = {"image": "image_position_ids", "video": "video_position_ids"}
# Video encoders whose frames (temporal rows of the grid) are encoded independently: attention within each frame
# (transformers' per-frame cu_seqlens), rotary / learned positions from (h, w) repeated over t. Proven by the
# "one_video" split cases of tests/test_multimodal.py.
FRAME_BASES = frozenset(
    {
        *("Qwen2VLModel", "Qwen2_5_VLModel", "Qwen3VLModel", "Qwen3VLMoeModel", "Qwen3_5Model", "Qwen3_5MoeModel"),
        *("Glm4vModel", "Glm4vMoeModel", "Glm46VModel", "GlmOcrModel"),
        "Qwen4ExpModel",  # Qwen3.5-MoE's tower: each frame attended alone
    }
)


@dataclass
class MediaLayout:
    """The units the media split over the ranks: each one's pixel rows, feature rows, medium and temporal rows."""

    pixel_rows: list[int]
    features: list[int] | None  # None: counted once encoded (LLaVA-Next), the units balanced by ``cost``
    medium: list[int]  # index of the unit's medium (its grid row / pixel tensor) in the batch
    frames: list[int]  # temporal grid rows of the unit (a whole medium: its t; a frame: 1)
    cost: list[int] | None = None  # what balances the groups when the feature rows aren't known yet (tiles)


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


def media_layout(base: torch.nn.Module, modality: str, kwargs: dict, placeholders: int) -> MediaLayout:
    """The batch's media of ``modality`` as units of the split. Raises a ``ValueError`` (the same on every rank:
    they hold the same batch) for a layout this phase can't split."""
    grid = kwargs.get(f"{modality}_grid_thw")
    pixels = kwargs[PIXELS[modality]]
    name = type(base).__name__
    if grid is not None:
        vision = base.config.vision_config
        merge = getattr(vision, "spatial_merge_size", None) or getattr(base.config, "spatial_merge_size", 2)
        by_frame = modality == "video" and name in FRAME_BASES
        per_row = merge * merge * temporal_merge(base.config, modality)  # patches per feature row
        newline = row_newline(base)  # HY-V4-VL: a newline feature ends each merged row of a frame
        units = []
        for medium, (t, h, w) in enumerate(grid.tolist()):
            for frames in [1] * t if by_frame else [t]:
                rows = frames * h * w // per_row + newline * frames * (h // merge)
                units.append((frames * h * w, rows, medium, frames))
        return MediaLayout(*(list(x) for x in zip(*units, strict=True)))
    positions = kwargs.get(PER_PIXEL_ROW[modality])
    if name in POSITION_BASES and positions is not None:
        k = base.config.vision_config.pooling_kernel_size
        features = ((positions != PADDING_POSITION).all(-1).sum(-1) // k**2).tolist()
        frames = kwargs.get("num_frames_per_video") if modality == "video" else None
        medium = None if frames is None else torch.repeat_interleave(frames.cpu()).tolist()
        return _row_per_unit(len(features), features, medium)
    if name in TILE_BASES and modality == "image" and pixels.ndim == 5 and kwargs.get("image_sizes") is not None:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        config = base.config
        tiles = [
            image_size_to_num_patches(size, config.image_grid_pinpoints, config.vision_config.image_size)
            for size in kwargs["image_sizes"].tolist()
        ]
        return _row_per_unit(pixels.shape[0], None, cost=tiles)
    if name in PER_IMAGE_BASES and pixels.ndim == 4 and placeholders % pixels.shape[0] == 0:
        n = pixels.shape[0]
        return _row_per_unit(n, [placeholders // n] * n)
    raise ValueError(
        f"split_media: {name}'s {modality} inputs (pixel values {tuple(pixels.shape)}) have no layout SP can split "
        "over its ranks (splittable: flat patches with a grid_thw row per medium, as Qwen-VL and GLM-4V, or one "
        f"fixed-size image per pixel tensor, as {', '.join(sorted(PER_IMAGE_BASES))}, Gemma4's patch rows, or "
        "LLaVA-Next's tiled images). "
        "Use split_media=False."
    )


def _row_per_unit(n: int, features: list[int] | None, medium: list[int] | None = None, cost=None) -> MediaLayout:
    """``n`` units of one pixel row (an image, a tile stack, a frame) each, each its own medium unless ``medium``."""
    return MediaLayout([1] * n, features, list(range(n)) if medium is None else medium, [1] * n, cost=cost)


def _group_inputs(kwargs: dict, modality: str, layout: MediaLayout, lo: int, hi: int) -> dict:
    """The per-medium encoder inputs of units ``lo .. hi - 1``: their media's rows, a grid row per medium whose ``t``
    counts only the group's frames of it."""
    medium = torch.tensor(layout.medium[lo:hi])
    ids, inverse = torch.unique_consecutive(medium, return_inverse=True)
    out = {}
    for name in PER_MEDIUM[modality]:
        value = kwargs.get(name)
        if value is not None:
            out[name] = value[ids.to(value.device)]
    frames = torch.zeros(len(ids), dtype=torch.long).index_add(0, inverse, torch.tensor(layout.frames[lo:hi]))
    grid = out.get(f"{modality}_grid_thw")
    if grid is not None:
        out[f"{modality}_grid_thw"] = torch.cat([frames.to(grid)[:, None], grid[:, 1:]], dim=1)
    counts = kwargs.get("num_frames_per_video") if modality == "video" else None
    if counts is not None:  # Gemma4: the group's frames of each of its videos
        out["num_frames_per_video"] = frames.to(counts)
    return out


def encode_split(encode, base, modality: str, kwargs: dict, placeholders: int, group) -> tuple | None:
    """The whole batch's feature rows ``[N, hidden]``, Qwen3-VL's deepstack levels (each ``[N, hidden]``) and this
    rank's own encoder output, this rank having encoded only its group of the media; ``None`` with fewer media than
    ranks (the caller then encodes them all)."""
    layout = media_layout(base, modality, kwargs, placeholders)
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    groups = balanced_groups(layout.cost or layout.features, sp)
    if groups is None:
        return None
    lo, hi = groups[rank]
    key = PIXELS[modality]
    starts = [0]
    for rows in layout.pixel_rows:
        starts.append(starts[-1] + rows)
    mine = dict(kwargs) | _group_inputs(kwargs, modality, layout, lo, hi)
    for name in (key, PER_PIXEL_ROW[modality]):  # the group's pixel rows (Gemma4: and their patch positions)
        if kwargs.get(name) is not None:
            mine[name] = kwargs[name][starts[lo] : starts[hi]]
    encoded = encode(base, modality, mine)
    features = getattr(encoded, feature_field(encoded))
    counts = layout.features or _counted(features, len(layout.medium), lo, hi, group)
    levels = [feature_rows(features)]
    levels += [feature_rows(level) for level in getattr(encoded, "deepstack_features", None) or []]
    local = torch.stack([x.reshape(-1, x.shape[-1]) for x in levels], 1)  # [rows, 1 + deepstack, hidden]
    if local.shape[0] != sum(counts[lo:hi]):
        raise ValueError(
            f"split_media: {type(base).__name__} encoded {local.shape[0]} feature rows for its {modality} units "
            f"{lo}..{hi - 1}, expected {sum(counts[lo:hi])}; use split_media=False."
        )
    width = max(sum(counts[a:b]) for a, b in groups)
    padded = torch.nn.functional.pad(local, (0, 0, 0, 0, 0, width - local.shape[0]))
    gathered = all_gather_stack(padded, group)  # [sp, width, levels, hidden]
    rows = torch.cat([gathered[r, : sum(counts[a:b])] for r, (a, b) in enumerate(groups)])
    return rows[:, 0], [rows[:, i] for i in range(1, rows.shape[1])], encoded


def _counted(pooled, units: int, lo: int, hi: int, group) -> list[int]:
    """Every unit's feature rows, each rank having encoded units ``lo .. hi - 1`` (a tuple of one tensor each): one
    small all-reduce."""
    if not isinstance(pooled, (list, tuple)) or len(pooled) != hi - lo:
        raise ValueError(f"split_media: expected one feature tensor per medium of units {lo}..{hi - 1}.")
    counts = torch.zeros(units, dtype=torch.long, device=pooled[0].device)
    counts[lo:hi] = torch.tensor([x.shape[0] for x in pooled], device=counts.device)
    dist.all_reduce(counts, group=group)
    return counts.tolist()
