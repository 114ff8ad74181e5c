"""Split media, the VLM path's second mode: the media split over the SP ranks (``multimodal/media_split.py``).
Exactness against each document alone runs in ``tests/test_multimodal.py``'s matrix (the ``_split`` cases) and
trainer cases."""

from __future__ import annotations

import pytest

from hf_sp_trainer.multimodal.media_split import balanced_groups, media_layout
from tests.multimodal_harness import LAYOUTS, Case, build_vlm, make_examples

pytestmark = pytest.mark.unit  # in-process


@pytest.mark.parametrize(
    "counts,parts",
    [([4, 4, 4, 4], 2), ([16, 1, 1, 1, 16], 2), ([1, 30, 2, 2, 2, 9], 4), ([5, 5, 5], 3), ([8] * 7, 4), ([1], 1)],
)
def test_balanced_groups_tile_the_media_contiguously(counts: list[int], parts: int) -> None:
    groups = balanced_groups(counts, parts)
    assert len(groups) == parts and groups[0][0] == 0 and groups[-1][1] == len(counts)
    assert all(a < b for a, b in groups) and all(b == c for (_, b), (c, _) in zip(groups, groups[1:], strict=False))
    loads = [sum(counts[a:b]) for a, b in groups]
    assert max(loads) - min(loads) <= max(counts), loads  # no group further from another than one medium


def test_balanced_groups_need_a_medium_per_rank() -> None:
    assert balanced_groups([3, 3, 3], 4) is None and balanced_groups([], 2) is None


def test_media_layouts() -> None:
    """Qwen-VL: a medium's patch rows from its grid, ``/ merge**2`` features (a video: one unit per frame); LLaVA: one
    pixel tensor and a fixed number of features per image (its "mixed" video is an image); Gemma4: a row of padded
    patches per image / frame, its real patches / k**2 features; LLaVA-Next: an image's tiles, balanced by their
    count, the feature rows counted once encoded; LLaVA-OneVision's (tiles only in single-image examples) and
    Idefics3's images per example are refused by name."""
    from hf_sp_trainer import SPMultimodalCollator
    from hf_sp_trainer.model.vlm import token_ids, vlm_base

    expected = {
        ("qwen2_vl", "image"): ([16, 24], [4, 6], [0, 1], [1, 1]),
        ("qwen2_vl", "video"): ([16, 16], [4, 4], [0, 0], [1, 1]),  # t = 2: two frames of one video
        ("llava", "image"): ([1, 1, 1], [16, 16, 16], [0, 1, 2], [1, 1, 1]),
        ("gemma4", "image"): ([1, 1], [4, 6], [0, 1], [1, 1]),  # real patches / 2**2 per patch row
        ("gemma4", "video"): ([1, 1], [4, 4], [0, 0], [1, 1]),  # a patch row per frame
        ("llava_next", "image"): ([1, 1, 1], None, [0, 1, 2], [1, 1, 1]),  # rows counted once encoded
    }
    for (family, modality), (pixels, features, medium, frames) in expected.items():
        model = build_vlm(family)
        batch = SPMultimodalCollator(model)(make_examples(LAYOUTS["mixed"], family))
        count = int((batch["input_ids"] == token_ids(model)[modality]).sum())
        got = media_layout(vlm_base(model), modality, batch, count)
        assert (got.pixel_rows, got.features, got.medium, got.frames) == (pixels, features, medium, frames), got
        assert got.features is None or sum(got.features) == count
    assert got.cost == [5, 5, 5], got.cost  # LLaVA-Next: its base view and 2 x 2 tiles of 8 x 8 per image
    for family in ("llava_onevision", "idefics3"):
        model = build_vlm(family)
        batch = SPMultimodalCollator(model)(make_examples(LAYOUTS["mixed"], family))
        count = int((batch["input_ids"] == token_ids(model)["image"]).sum())
        with pytest.raises(ValueError, match=r"no layout SP can split.*Use split_media=False"):
            media_layout(vlm_base(model), "image", batch, count)


def test_a_video_split_by_frame_gets_a_grid_row_per_part() -> None:
    """Units 1..4: the last three frames of a 4-frame video and the first frame of the next, as grid rows
    ``(3, h, w)`` and ``(1, h', w')``, their per-medium rows (``second_per_grid_ts``) taken along."""
    import torch

    from hf_sp_trainer.multimodal.media_split import MediaLayout, _group_inputs

    grid = torch.tensor([[4, 2, 4], [3, 4, 4]])
    kwargs = {"video_grid_thw": grid, "second_per_grid_ts": torch.tensor([0.5, 1.0])}
    layout = MediaLayout([8] * 4 + [16] * 3, [2] * 4 + [4] * 3, [0] * 4 + [1] * 3, [1] * 7)
    got = _group_inputs(kwargs, "video", layout, 1, 5)
    assert got["video_grid_thw"].tolist() == [[3, 2, 4], [1, 4, 4]], got
    assert got["second_per_grid_ts"].tolist() == [0.5, 1.0]
    whole = MediaLayout([32, 48], [8, 12], [0, 1], [4, 3])  # a medium per unit: the grid rows as they were
    assert _group_inputs(kwargs, "video", whole, 1, 2)["video_grid_thw"].tolist() == [[3, 4, 4]]
    gemma4 = {"num_frames_per_video": torch.tensor([4, 3])}  # Gemma4: the group's frames of each video
    assert _group_inputs(gemma4, "video", layout, 1, 5)["num_frames_per_video"].tolist() == [3, 1]


def test_split_layouts_are_the_proven_ones() -> None:
    """Every video encoder split by frame has a "one_video" split case in the sp-2 matrix, every per-image layout a
    split case on images, and only those (the others split on images have grid rows: ERNIE-4.5-VL's whole media)."""
    from hf_sp_trainer.model.vlm import vlm_base
    from hf_sp_trainer.multimodal.media_split import FRAME_BASES, PER_IMAGE_BASES, POSITION_BASES, TILE_BASES
    from tests.test_multimodal import SP2

    def bases(cases) -> set[str]:
        return {type(vlm_base(build_vlm(c.family))).__name__ for c in cases}

    from tests.multimodal_harness import FAMILIES

    installed = bases(Case(f, "mixed") for f in FAMILIES)  # before transformers 5.24 some bases are absent
    FRAME, PER_IMAGE, POSITION, TILE = (
        b & installed for b in (FRAME_BASES, PER_IMAGE_BASES, POSITION_BASES, TILE_BASES)
    )
    split = [c for c in SP2 if c.split]
    assert bases(c for c in split if c.layout == "one_video") == FRAME | POSITION
    on_images = bases(c for c in split if c.layout in ("mixed", "many", "images"))
    gridded = bases(c for c in split if any("image_grid_thw" in x for x in make_examples(LAYOUTS[c.layout], c.family)))
    per_image = on_images - FRAME - POSITION - TILE - gridded
    assert per_image == PER_IMAGE and POSITION | TILE <= on_images, (per_image, PER_IMAGE)
