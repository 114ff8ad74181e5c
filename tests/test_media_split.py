"""Phase 2 of the VLM path: the media split over the SP ranks (``multimodal/media_split.py``). Exactness against each
document alone runs in ``tests/test_multimodal.py``'s matrix (the ``_split`` cases) and trainer cases."""

from __future__ import annotations

import pytest

from hf_sp_trainer.multimodal.media_split import balanced_groups, media_layout
from tests.multimodal_harness import LAYOUTS, build_vlm, make_examples


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
    """Qwen-VL: a medium's patch rows from its grid, ``/ merge**2`` features; LLaVA: one pixel tensor and a fixed
    number of features per image (its "mixed" video is an image); LLaVA-Next's any-resolution tiles and InternVL's
    tiles are refused by name."""
    from hf_sp_trainer import SPMultimodalCollator
    from hf_sp_trainer.multimodal.parts import token_ids, vlm_base

    for family, patches, features in (("qwen2_vl", [16, 24], [4, 6]), ("llava", [1, 1, 1], [16, 16, 16])):
        model = build_vlm(family)
        batch = SPMultimodalCollator(model)(make_examples(LAYOUTS["mixed"], family))
        count = int((batch["input_ids"] == token_ids(model)["image"]).sum())
        got = media_layout(vlm_base(model), "image", batch, count)
        assert got == (patches, features) and sum(got[1]) == count, got
    for family in ("llava_next", "internvl"):
        model = build_vlm(family)
        batch = SPMultimodalCollator(model)(make_examples(LAYOUTS["mixed"], family))
        count = int((batch["input_ids"] == token_ids(model)["image"]).sum())
        with pytest.raises(ValueError, match=r"no layout SP can split.*Use split_media=False"):
            media_layout(vlm_base(model), "image", batch, count)
