"""Vision-language models under SP against each document run alone through the model's own forward (its own
positions and merge): loss and every gradient, the vision tower's included, at sp 2 and 4, Ulysses and ring; the
Trainer against plain ``Trainer``; the refusals and bad inputs."""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.exactness import assert_exact
from tests.harness import params_rel, run_distributed, trainer_diffs, unwrap_results
from tests.multimodal_harness import (
    FAMILIES,
    IMG,
    LAYOUTS,
    NEAR_THE_BAR,
    Case,
    build_vlm,
    make_examples,
    run_matrix,
    train_vlm,
)
from tests.upstream import CACHE_ARGUMENT

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

SP2 = [
    Case("qwen2_vl", "mixed"),
    Case("qwen2_vl", "padded"),
    Case("qwen2_vl", "mixed", ring=2),
    Case("qwen2_vl", "mixed", frozen=True),
    Case("qwen2_5_vl", "mixed"),
    Case("qwen2_5_vl", "padded", ring=2),
    Case("qwen3_vl", "mixed"),
    Case("qwen3_vl_moe", "padded"),
    Case("qwen3_5", "mixed"),
    Case("qwen3_5", "padded", ring=2),
    Case("qwen3_5_moe", "mixed"),  # Qwen3.5's hybrid with MoE MLPs
    Case("qwen3_5_moe", "padded", ring=2),
    Case("llava", "mixed"),
    Case("llava", "padded", ring=2),
    Case("internvl", "mixed"),
    Case("internvl", "padded", ring=2),
    Case("llava_next", "mixed"),
    Case("llava_next", "padded", ring=2),
    Case("mistral3", "mixed", ring=2),
    Case("mistral3", "padded"),
    Case("lfm2_vl", "mixed"),
    Case("lfm2_vl", "padded", ring=2),
    Case("glm4v", "images"),
    Case("glm4v", "videos", ring=2),
    Case("glm4v_moe", "videos"),
    Case("glm46v", "images", ring=2),
    Case("gemma3", "mixed"),  # each image's tokens see the whole image, a window cutting through it
    Case("gemma3", "mixed", ring=2),  # the rest of an image in a later chunk: a block a causal ring skips
    Case("gemma3", "padded", frozen=True),
    Case("gemma4", "mixed"),  # the same on its sliding layers only (window 5 < an image); per-layer head sizes
    Case("gemma4", "mixed", ring=2),
    Case("gemma4", "padded", frozen=True),
    Case("gemma4", "videos"),  # a video's frames: runs of their own
    Case("gemma4_causal", "mixed"),  # use_bidirectional_attention=None: causal throughout
    Case("gemma4_causal", "padded", ring=2),
    Case("aya_vision", "mixed"),
    Case("aya_vision", "padded", ring=2),
    Case("cohere2_vision", "mixed", ring=2),
    Case("lighton_ocr", "mixed"),
    Case("lighton_ocr", "padded", ring=2),
    Case("idefics3", "mixed"),
    Case("smolvlm", "padded", ring=2),
    Case("idefics2", "mixed"),  # a perceiver resampler between the tower and the decoder
    Case("idefics2", "padded", ring=2),
    Case("got_ocr2", "mixed"),  # a SAM tower, windowed, with relative positions; strided convs to the placeholders
    Case("got_ocr2", "padded", ring=2),
    Case("llava_onevision", "mixed"),  # one image: tiles; several: base views only (batch_num_images)
    Case("llava_onevision", "padded", ring=2),
    Case("vipllava", "mixed"),
    Case("vipllava", "padded", ring=2),
    Case("video_llava", "mixed"),  # images and videos, each through its own tower
    Case("video_llava", "mixed", ring=2),
    Case("llava_next_video", "mixed"),  # LLaVA-Next's tiled images and pooled video frames
    Case("llava_next_video", "padded", ring=2),
    Case("glm_ocr", "images"),
    Case("glm_ocr", "videos", ring=2),
    Case("paddleocr_vl", "images"),
    Case("paddleocr_vl", "padded", ring=2),
    Case("qianfan_ocr", "mixed"),
    Case("qianfan_ocr", "padded", ring=2),
    # Llama-4: tiles; chunks of 8 and the NoPE temperature (floor 4) in its decoder (tests/multimodal_llama4.py)
    Case("llama4", "mixed"),
    Case("llama4", "padded", ring=2),
    Case("llama4", "padded", frozen=True),  # the tower frozen, its projector (run after the merge) trained
    Case("llama4", "many", split=True),  # split media: its tiles split over the ranks, each encoded alone
    # split media: the media split over the ranks, their features exchanged
    Case("qwen2_vl", "mixed", split=True),  # two images split, the one video's two frames too
    Case("llava", "many", split=True),
    Case("glm4v", "images", ring=2, split=True),
    Case("gemma3", "many", frozen=True, split=True),
    Case("gemma4", "many", ring=2, split=True),  # rows of padded patches with their positions (POSITION_BASES)
    Case("llava_next", "many", split=True),  # tiled images, their feature rows counted once encoded (TILE_BASES)
    Case("llava_next_video", "images", ring=2, split=True),
    # images (InternVL: tiles) of a fixed feature count, each encoded alone (PER_IMAGE_BASES)
    Case("vipllava", "many", split=True),
    Case("internvl", "many", ring=2, split=True),
    Case("qianfan_ocr", "many", split=True),
    Case("aya_vision", "many", ring=2, split=True),
    Case("cohere2_vision", "many", split=True),
    Case("got_ocr2", "many", ring=2, split=True),
    # one long video split over the ranks by frame (FRAME_BASES): every frame-independent video encoder
    Case("qwen2_vl", "one_video", split=True),
    Case("qwen2_5_vl", "one_video", ring=2, split=True),
    Case("qwen3_vl", "one_video", split=True),
    Case("qwen3_vl_moe", "one_video", ring=2, split=True),
    Case("qwen3_5", "one_video", split=True),
    Case("qwen3_5_moe", "one_video", ring=2, split=True),
    Case("glm4v", "one_video", ring=2, split=True),
    Case("glm4v_moe", "one_video", split=True),
    Case("glm46v", "one_video", split=True),
    Case("glm_ocr", "one_video", ring=2, split=True),
    Case("gemma4", "one_video", split=True),
    # tests/multimodal_families_extra.py: Kimi-K2.5 (a DeepSeek-V3 decoder; videos pooled per chunk of frames) and
    # dots3-note (DSA, top-5 keys per query, and a sliding window of 7; Ulysses, and a ring: the all-gather path)
    Case("kimi_k25", "mixed"),
    Case("kimi_k25", "padded", ring=2),
    Case("dots3_note", "mixed"),
    Case("dots3_note", "padded", ring=2),  # DSA with a ring: the ring group's K/V gathered
    # Mistral-Large-4: Pixtral's images, DSA with top-5 keys per query on RoPE / NoPE / shared-top-k / kv-sharing
    # layers, its queries scaled by their document positions (Ulysses, and a ring)
    Case("mistral_large4", "mixed"),
    Case("mistral_large4", "padded", ring=2),  # DSA with a ring: the ring group's K/V gathered
    # MiniMax-M3-VL: block-sparse selection (top-2 blocks of 4 keys per KV group plus the local one; and a ring)
    Case("minimax_m3_vl", "mixed"),
    Case("minimax_m3_vl", "padded", ring=2),
    # HY-V4-VL: mrope; HY-V4's DSA (top-5 keys, a layer reusing another's), sinks, hyper-connections (and a ring).
    # Its fp32 gap (up to 8e-6, a hyper-connection gradient summed with cancellation) is 1e-14 in float64
    Case("hy_v4_vl", "mixed"),
    Case("hy_v4_vl", "padded", ring=2),  # DSA with a ring: the ring group's K/V gathered
    Case("hy_v4_vl", "many", split=True),  # split media: each frame's merged rows end with a newline feature row
    # tests/multimodal_families_mrope.py: ERNIE-4.5-VL (experts per modality by moe_mm_token_type_ids; videos' frames
    # merged in pairs; "images": an image across the sp-2 boundary) and Qwen4-Exp (Gated DeltaNet, top-2 blocks of 4
    # by its QSA indexer on mrope positions, PLE n-grams; Ulysses and ring)
    Case("ernie4_5_vl_moe", "mixed"),
    Case("ernie4_5_vl_moe", "padded"),
    Case("ernie4_5_vl_moe", "images", ring=2),
    Case("ernie4_5_vl_moe", "padded", ring=2),
    Case("ernie4_5_vl_moe", "many", split=True),  # a video's feature rows: its frames merged in pairs
    Case("qwen4_exp", "mixed"),
    Case("qwen4_exp", "padded", ring=2),
    Case("qwen4_exp", "one_video", split=True),  # its video split over the ranks by frame (FRAME_BASES)
    # GLM-5-Next: pooled DSA (the best 2 pools of 4 keys from each document's start, the query's own pool's tail; a
    # layer reusing the first's selection) with KDA layers, NoPE; its videos' frames image tokens inside spans
    Case("glm5_next", "images"),
    Case("glm5_next", "videos"),  # a span opened on one shard continued on the next: told apart on the whole row
    Case("glm5_next", "videos", ring=2),
]
SP4 = [
    Case("qwen2_vl", "mixed", ring=2),
    Case("qwen2_5_vl", "padded"),
    Case("qwen3_vl", "mixed", ring=2),
    Case("qwen3_5", "mixed", ring=2),
    Case("qwen3_vl_moe", "mixed", ring=2),
    Case("llava", "padded"),
    Case("internvl", "padded"),
    Case("llava_next", "padded"),
    Case("mistral3", "mixed"),
    Case("lfm2_vl", "padded", ring=2),
    Case("glm4v", "videos", ring=2),
    Case("glm4v_moe", "images", ring=2),
    Case("gemma3", "mixed"),
    Case("gemma3", "mixed", ring=2),
    Case("gemma3", "padded", ring=4),
    Case("gemma4", "mixed"),
    Case("gemma4", "mixed", ring=2),
    Case("gemma4", "padded", ring=4),
    Case("gemma4_causal", "mixed", ring=2),
    Case("aya_vision", "padded", ring=2),
    Case("cohere2_vision", "mixed"),
    Case("lighton_ocr", "mixed"),
    Case("smolvlm", "mixed", ring=2),
    Case("idefics3", "padded", ring=2),
    Case("idefics2", "padded"),
    Case("idefics2", "mixed", ring=2),
    Case("got_ocr2", "padded"),
    Case("got_ocr2", "mixed", ring=2),
    Case("llava_onevision", "padded"),
    Case("llava_onevision", "mixed", ring=2),
    Case("qwen3_5_moe", "mixed", ring=2),
    Case("vipllava", "padded"),
    Case("video_llava", "mixed", ring=2),
    Case("llava_next_video", "padded"),
    Case("glm_ocr", "images", ring=2),
    Case("paddleocr_vl", "padded"),
    Case("qianfan_ocr", "padded"),
    Case("llama4", "mixed", ring=2),  # Ulysses 2 x ring 2
    Case("llama4", "padded"),  # Ulysses 4: each kv head repeated
    Case("llama4", "many", ring=2, split=True),
    Case("qwen3_vl", "many", ring=2, split=True),  # deepstack levels exchanged with the features
    Case("qwen2_5_vl", "many", split=True),
    Case("llava", "many", ring=2, split=True),
    Case("internvl", "many", split=True),
    Case("got_ocr2", "many", ring=2, split=True),
    Case("qwen2_vl", "one_video", split=True),  # a frame per rank
    Case("qwen3_vl", "one_video", ring=2, split=True),
    Case("glm4v", "one_video", split=True),
    Case("gemma4", "many", split=True),
    Case("gemma4", "one_video", ring=2, split=True),
    Case("llava_next", "many", ring=2, split=True),
    Case("kimi_k25", "padded"),
    Case("kimi_k25", "mixed", ring=2),
    Case("dots3_note", "mixed"),
    Case("dots3_note", "padded", ring=2),  # DSA with a ring: the ring group's K/V gathered
    Case("mistral_large4", "mixed"),
    Case("mistral_large4", "padded", ring=2),  # DSA with a ring: the ring group's K/V gathered
    Case("minimax_m3_vl", "mixed"),
    Case("minimax_m3_vl", "padded", ring=2),
    Case("hy_v4_vl", "mixed"),
    Case("hy_v4_vl", "padded", ring=2),  # DSA with a ring: the ring group's K/V gathered
    Case("ernie4_5_vl_moe", "mixed"),
    Case("ernie4_5_vl_moe", "padded", ring=2),
    Case("ernie4_5_vl_moe", "images", ring=4),
    Case("qwen4_exp", "mixed"),
    Case("qwen4_exp", "padded", ring=2),
    # GLM-5-Next: pooled DSA (the best 2 pools of 4 keys from each document's start, the query's own pool's tail; a
    # layer reusing the first's selection) with KDA layers, NoPE; its videos' frames image tokens inside spans
    Case("glm5_next", "images", ring=2),  # Ulysses 2 x ring 2: the pooled selection over zigzag shards
    Case("glm5_next", "videos"),
    Case("glm5_next", "videos", ring=4),
]
SP2, SP4 = ([c for c in cases if c.family in FAMILIES] for cases in (SP2, SP4))  # the installed transformers' VLMs


# The text decoder's length-dependent settings crossed under the rows (tests/length_crossing.py): every family with
# one to cross (windows, a window its config can switch on), Ulysses and ring
CROSSED = [
    Case("qwen2_vl", "mixed", crossed=True),
    Case("qwen2_5_vl", "padded", ring=2, crossed=True),
    Case("internvl", "mixed", crossed=True),
    Case("qianfan_ocr", "padded", ring=2, crossed=True),
    Case("got_ocr2", "mixed", crossed=True),
    Case("mistral3", "mixed", ring=2, crossed=True),
    Case("gemma3", "mixed", ring=2, crossed=True),
    Case("aya_vision", "mixed", crossed=True),
    Case("cohere2_vision", "mixed", ring=2, crossed=True),
    Case("idefics2", "mixed", crossed=True),
]
SP2 += CROSSED
ACTS = 1e-4  # a crossed setting must change the reference by more than this


@pytest.fixture(scope="module")
def sp2_results() -> dict[str, dict]:
    return unwrap_results(run_distributed(2, run_matrix, SP2, 2))[0]


@pytest.fixture(scope="module")
def sp4_results() -> dict[str, dict]:
    return unwrap_results(run_distributed(4, run_matrix, SP4, 4))[0]


@pytest.mark.matrix
@pytest.mark.parametrize("case", SP2, ids=lambda c: c.name)
def test_vlm_sp2_matches_each_document_alone(case: Case, sp2_results: dict) -> None:
    result = sp2_results[case.name]
    assert result["exact"], result["verdict"]  # tests/exactness.py: in float64 too past EXACT, or near the bar
    assert result["float64"] is not None or case.family not in NEAR_THE_BAR, result["verdict"]
    assert (result["exchanged"] > 0) == case.split, result  # split media ran where asked, and only there
    if case.crossed:
        assert result["crossed"] and result["acts"] > ACTS, f"{case.name}: crossing {result['crossed']} changed nothing"


@pytest.mark.matrix
@pytest.mark.parametrize("case", SP4, ids=lambda c: c.name)
def test_vlm_sp4_matches_each_document_alone(case: Case, sp4_results: dict) -> None:
    result = sp4_results[case.name]
    assert result["exact"], result["verdict"]
    assert result["float64"] is not None or case.family not in NEAR_THE_BAR, result["verdict"]
    assert (result["exchanged"] > 0) == case.split, result


def test_layouts_cover_the_hard_places() -> None:
    """The "mixed" row (GLM-4V: "images", "videos") opens with an image and has an image run (a video frame) across
    the sp-2 boundary; "padded" needs SP's padding document at sp 2 and 4."""
    from hf_sp_trainer import SPMultimodalCollator

    pairs = [("qwen2_vl", "mixed"), ("internvl", "mixed"), ("llava_next", "mixed"), ("mistral3", "mixed")]
    pairs += [("glm4v", "images"), ("gemma3", "mixed"), ("aya_vision", "mixed"), ("lighton_ocr", "mixed")]
    pairs += [("gemma4", "mixed"), ("llama4", "mixed"), ("kimi_k25", "mixed"), ("dots3_note", "mixed")]
    pairs += [("minimax_m3_vl", "mixed"), ("ernie4_5_vl_moe", "images"), ("qwen4_exp", "mixed")]
    pairs += [("hy_v4_vl", "mixed"), ("glm5_next", "images")]
    for family, layout in [*pairs, ("glm4v", "videos"), ("glm5_next", "videos")]:
        if family not in FAMILIES:  # not in the installed transformers (or refused before 5.24)
            continue
        row = SPMultimodalCollator(build_vlm(family))(make_examples(LAYOUTS[layout], family))["input_ids"][0]
        half = len(row) // 2 + len(row) % 2
        assert row[half - 1] == IMG and row[half] == IMG, (family, layout, row.tolist())
        assert layout == "videos" or IMG in row[:2], (family, layout, row.tolist())
    model = build_vlm("qwen2_vl")
    padded = SPMultimodalCollator(model)(make_examples(LAYOUTS["padded"]))["input_ids"]
    assert padded.shape[1] % 4 and padded.shape[1] % 2, padded.shape


def _sp_trainer_job(
    family: str, sp_size: int, ring: int | None, lora: bool, split: bool = False, router_loss: bool = False
) -> dict:
    with tempfile.TemporaryDirectory() as out:
        return train_vlm(family, sp_size, ring, out, lora=lora, split=split, router_loss=router_loss)


# name: (family, world size, sp_size, ring, lora, split media, MoE router loss); the reference: plain Trainer on
# world / sp DDP processes
TRAINER_CASES = {
    "qwen2_vl_sp2_ga2": ("qwen2_vl", 2, 2, None, False, False, False),
    "qwen2_vl_lora_frozen_tower_sp2": ("qwen2_vl", 2, 2, None, True, False, False),
    "qwen3_vl_sp4_ring2_ga2": ("qwen3_vl", 4, 4, 2, False, False, False),
    "qwen2_vl_dp2_sp2_split_media": ("qwen2_vl", 4, 2, None, False, True, False),  # split media under data parallelism
    "gemma3_sp2_ring2_ga2": ("gemma3", 2, 2, 2, False, False, False),  # image tokens see their whole image, a ring
    "gemma4_sp2_ring2_ga2": ("gemma4", 2, 2, 2, False, False, False),  # the same on its sliding layers only
    "smolvlm_sp2_ga2": ("smolvlm", 2, 2, None, False, False, False),  # 1-D positions, the decoder at text_model
    # the MoE decoder's load-balancing loss in the loss (coefficient 0.5): one product of averages over the batch
    "qwen3_vl_moe_router_loss_sp2_ga2": ("qwen3_vl_moe", 2, 2, None, False, False, True),
    "qwen3_5_moe_router_loss_sp2_ga2": ("qwen3_5_moe", 2, 2, None, False, False, True),  # hybrid + MoE
    # chunks of 8, the NoPE temperature, a MoE layer; its forward's tuple path (tests/multimodal_llama4.py)
    "llama4_sp2_ring2_ga2": ("llama4", 2, 2, 2, False, False, False),
    # selecting attentions: Mistral-Large-4's DSA (top-5 keys; RoPE, NoPE, shared-top-k and
    # kv-sharing layers; its router has no load-balancing loss), MiniMax-M3-VL's blocks (top-2 of 4 keys plus the
    # local one) with its MoE router loss
    "mistral_large4_sp2_ga2": ("mistral_large4", 2, 2, None, False, False, False),
    "minimax_m3_vl_router_loss_sp2_ga2": ("minimax_m3_vl", 2, 2, None, False, False, True),
    # experts per modality (moe_mm_token_type_ids packed and sharded), its router loss, a ring; pooled DSA + KDA
    "ernie4_5_vl_moe_router_loss_sp2_ring2_ga2": ("ernie4_5_vl_moe", 2, 2, 2, False, False, True),
    "glm5_next_sp2_ga2": ("glm5_next", 2, 2, None, False, False, False),
    "glm5_next_sp2_ring2_ga2": ("glm5_next", 2, 2, 2, False, False, False),  # the pooled selection with a ring
    "hy_v4_vl_sp2_ga2": ("hy_v4_vl", 2, 2, None, False, False, False),
    # the frontier VLMs at sp 4 with a ring (Ulysses 2 x ring 2: their selections' all-gather path)
    "hy_v4_vl_sp4_ring2_ga2": ("hy_v4_vl", 4, 4, 2, False, False, False),
    "minimax_m3_vl_router_loss_sp4_ring2_ga2": ("minimax_m3_vl", 4, 4, 2, False, False, True),
    "qwen4_exp_sp4_ring2_ga2": ("qwen4_exp", 4, 4, 2, False, False, False),  # QSA, Gated DeltaNet, PLE n-grams
}
TRAINER_CASES = {name: case for name, case in TRAINER_CASES.items() if case[0] in FAMILIES}  # installed transformers'


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_sp_trainer_matches_trainer(name: str) -> None:
    """``SPTrainer`` (default collator: multimodal packing) against plain ``Trainer`` with one padded row per document
    (one process, or DDP for dp 2 x sp 2): per-step loss and grad_norm, and the weights after three SGD steps of two
    micro-batches each (Qwen-VL sets ``accepts_loss_kwargs = False``: the Trainer's per-micro-batch mean, reproduced
    under SP); LoRA on the decoder with the vision tower frozen; MoE decoders with their router load-balancing loss
    in the loss (every forward returned one)."""
    family, world, sp_size, ring, lora, split, router_loss = TRAINER_CASES[name]
    dp = world // sp_size
    if dp == 1:
        with tempfile.TemporaryDirectory() as out:
            ref = train_vlm(family, 1, None, out, lora=lora, router_loss=router_loss)
    else:
        ref = unwrap_results(run_distributed(dp, _sp_trainer_job, family, 1, None, lora, False, router_loss))[0]
    got = unwrap_results(run_distributed(world, _sp_trainer_job, family, sp_size, ring, lora, split, router_loss))[0]
    assert (got["exchanged"] > 0) == split, got["exchanged"]
    assert not router_loss or (ref["router_loss"] and got["router_loss"]), (ref["router_loss"], got["router_loss"])
    print(name, "losses", got["losses"], ref["losses"], "weights", f"{params_rel(got['params'], ref['params']):.2e}")
    assert_exact(name, trainer_diffs(got, ref, steps=3))


# -- bad input: a ValueError on every rank, nothing hangs --------------------------------------------------------
def _bad_inputs() -> dict[str, str]:
    import torch.distributed as dist

    from hf_sp_trainer import SPMultimodalCollator, apply_sequence_parallel

    dist.init_process_group("gloo")
    model = build_vlm("qwen2_vl")
    batch = SPMultimodalCollator(model)(make_examples(LAYOUTS["mixed"]))
    out = {}
    with apply_sequence_parallel(model, 2) as sp:
        extra = dict(batch, input_ids=batch["input_ids"].clone())
        extra["input_ids"][0, -2] = IMG  # one placeholder more than the images' feature rows
        without_text_row = dict(batch, position_ids=batch["position_ids"][1:])
        flat = dict(batch, position_ids=batch["position_ids"][0])
        for name, bad in (("count", extra), ("no_text_row", without_text_row), ("1d_positions", flat)):
            try:
                shard = sp.shard_batch(bad)
                shard.pop("labels"), shard.pop("shift_labels")
                model(**shard)
                out[name] = "no error"
            except ValueError as exc:
                out[name] = str(exc)
    glm = build_vlm("glm4v")  # images and videos share GLM-4V's placeholder token: one batch can't hold both
    examples = make_examples(LAYOUTS["images"][:1], "glm4v") + make_examples(LAYOUTS["videos"][:1], "glm4v")
    with apply_sequence_parallel(glm, 2) as sp:
        shard = sp.shard_batch(SPMultimodalCollator(glm)(examples))
        shard.pop("labels"), shard.pop("shift_labels")
        try:
            glm(**shard)
            out["shared_token"] = "no error"
        except ValueError as exc:
            out["shared_token"] = str(exc)
    gemma4 = build_vlm("gemma4")  # audio is merged inside Gemma4's forward: refused before any collective
    with apply_sequence_parallel(gemma4, 2) as sp:
        shard = sp.shard_batch(SPMultimodalCollator(gemma4)(make_examples(LAYOUTS["mixed"], "gemma4")))
        shard.pop("labels"), shard.pop("shift_labels")
        try:
            gemma4(**shard, input_features=torch.zeros(1, 8, 16), input_features_mask=torch.ones(1, 8).bool())
            out["audio"] = "no error"
        except ValueError as exc:
            out["audio"] = str(exc)
    return out


@pytest.mark.dist
def test_bad_multimodal_inputs_raise_on_every_rank() -> None:
    results = unwrap_results(run_distributed(2, _bad_inputs))
    for rank in results:
        assert "placeholder tokens but its pixel_values encode to" in rank["count"], rank["count"]
        assert "[4, batch, seq]" in rank["no_text_row"], rank["no_text_row"]
        assert "multimodal" in rank["1d_positions"] and "per document" in rank["1d_positions"], rank["1d_positions"]
        assert "same token (id 120)" in rank["shared_token"], rank["shared_token"]
        assert "got audio (input_features)" in rank["audio"] and "sp_size=1" in rank["audio"], rank["audio"]


def test_collator_checks_placeholders_against_grids() -> None:
    from hf_sp_trainer import SPMultimodalCollator

    model = build_vlm("qwen2_vl")
    example = make_examples(LAYOUTS["mixed"][:1])[0]
    example["input_ids"] = torch.cat([example["input_ids"], torch.tensor([IMG])])
    with pytest.raises(ValueError, match="5 image placeholder tokens but its image_grid_thw"):
        SPMultimodalCollator(model)([example])
    gemma4 = build_vlm("gemma4")  # Gemma4: its patch positions (real patches / 2**2 features per image)
    example = make_examples(LAYOUTS["mixed"][:1], "gemma4")[0]
    example["image_position_ids"][0, 15] = -1  # one real patch fewer: 15 // 4 = 3 features
    with pytest.raises(ValueError, match=r"4 image placeholder tokens but its image_position_ids with \[15\] real"):
        SPMultimodalCollator(gemma4)([example])
    if "hy_v4_vl" not in FAMILIES:  # transformers 5.25 added HY-V4-VL
        return
    hy = build_vlm("hy_v4_vl")  # HY-V4-VL: 2 merged rows of 2 + 1 (a newline) placeholders; without the newlines
    example = make_examples(LAYOUTS["mixed"][:1], "hy_v4_vl")[0]
    example["input_ids"] = torch.cat([example["input_ids"][:5], example["input_ids"][7:]])
    with pytest.raises(ValueError, match=r"4 image placeholder tokens but its image_grid_thw \[\[1, 4, 4\]\] gives 6"):
        SPMultimodalCollator(hy)([example])


def test_collator_pads_llava_next_tiles_across_examples() -> None:
    """LLaVA-Next examples with different tile counts: zero-padded to the most tiles, as its processor pads a batch
    (the "padded" layout's row is exact under SP only if the model reads the real tiles from ``image_sizes``)."""
    from hf_sp_trainer import SPMultimodalCollator

    examples = make_examples(LAYOUTS["padded"], "llava_next")
    tiles = [ex["pixel_values"].shape[1] for ex in examples if "pixel_values" in ex]
    assert len(set(tiles)) > 1, tiles
    pixels = SPMultimodalCollator(build_vlm("llava_next"))(examples)["pixel_values"]
    assert pixels.shape[1] == max(tiles)
    short = next(ex["pixel_values"] for ex in examples if ex["pixel_values"].shape[1] < max(tiles))
    assert torch.equal(pixels[-1, : short.shape[1]], short[-1]) and not pixels[-1, short.shape[1] :].any()


def test_collator_carries_llava_onevision_image_counts() -> None:
    """LLaVA-OneVision tiles an image only in an example with one image: the collator lays each example's
    ``batch_num_images`` end to end (one per document, in image order) and refuses counts that don't match."""
    from hf_sp_trainer import SPMultimodalCollator

    examples = make_examples(LAYOUTS["padded"], "llava_onevision")
    collator = SPMultimodalCollator(build_vlm("llava_onevision"))
    assert collator(examples)["batch_num_images"].tolist() == [2, 1]
    examples[1]["batch_num_images"] = torch.tensor([2])
    with pytest.raises(ValueError, match="Example 1 has 1 images but batch_num_images 2"):
        collator(examples)
    del examples[1]["batch_num_images"]
    with pytest.raises(ValueError, match="Example 1 has 1 images but batch_num_images None"):
        collator(examples)


def test_collator_types_shared_placeholders_by_the_examples_media() -> None:
    """GLM-4V's video frames sit at the image token: the collator types them by the example's media (its own
    ``get_rope_index`` needs that), and refuses an example holding both."""
    from hf_sp_trainer import SPMultimodalCollator
    from hf_sp_trainer.model.vlm import token_ids

    model = build_vlm("glm4v")
    assert token_ids(model) == {"image": IMG, "video": IMG}
    for layout in ("images", "videos"):
        examples = make_examples(LAYOUTS[layout], "glm4v")
        types = SPMultimodalCollator(model)(examples)["mm_token_type_ids"][0]
        assert torch.equal(types, torch.cat([ex["mm_token_type_ids"] for ex in examples]))
    both = make_examples(LAYOUTS["images"][:1], "glm4v")[0] | make_examples(LAYOUTS["videos"][:1], "glm4v")[0]
    with pytest.raises(ValueError, match="holds images and videos"):
        SPMultimodalCollator(model)([both])


def test_collator_positions_are_the_models_own_per_document() -> None:
    """Each document's mrope rows are ``get_rope_index`` of it alone; the text row restarts at 0 per document."""
    from hf_sp_trainer import SPMultimodalCollator
    from hf_sp_trainer.collators.multimodal import MODALITY_TYPE

    model = build_vlm("qwen2_5_vl")
    examples = make_examples(LAYOUTS["mixed"])
    positions = SPMultimodalCollator(model)(examples)["position_ids"]
    start = 0
    for ex in examples:
        ids = ex["input_ids"][None]
        n = ids.shape[1]
        types = torch.zeros_like(ids)
        types[ids == IMG] = MODALITY_TYPE["image"]
        types[ids == 121] = MODALITY_TYPE["video"]
        grids = {k: ex[k] for k in ("image_grid_thw", "video_grid_thw") if k in ex}
        own = model.model.get_rope_index(ids, types, **grids)[0] if grids else torch.arange(n).expand(3, 1, n)
        assert torch.equal(positions[1:, :, start : start + n], own)
        assert torch.equal(positions[0, 0, start : start + n], torch.arange(n))
        start += n


def test_sharding_keeps_media_whole_and_splits_rope_rows() -> None:
    from hf_sp_trainer import SPMultimodalCollator
    from hf_sp_trainer.sharding import SequenceSharding

    model = build_vlm("qwen2_vl")
    batch = SPMultimodalCollator(model)(make_examples(LAYOUTS["padded"]))
    length = batch["input_ids"].shape[1]
    sharding = SequenceSharding(2, ring_size=2)
    shards = [sharding.shard_batch(batch, r) for r in range(2)]
    padded = length + (-length % 4)
    for r, shard in enumerate(shards):
        assert shard["position_ids"].shape == (4, 1, padded // 2)
        assert torch.equal(shard["pixel_values"], batch["pixel_values"])
        assert torch.equal(shard["image_grid_thw"], batch["image_grid_thw"])
        index = sharding.positions(padded, r)
        assert torch.equal(shard["input_ids"][0], torch.cat([batch["input_ids"][0], torch.zeros(4)]).long()[index])
    pad_rows = shards[1]["position_ids"][:, 0, -1]
    assert bool((pad_rows == pad_rows[0]).all())  # the padding document: every row numbers it alike


# -- what SP refuses, and the encoders' guard ------------------------------------------------------------------
def test_vision_tower_never_runs_sp_attention() -> None:
    """The SP attention refuses a module outside every text decoder it was attached to (a vision block), before any
    communication; attaching leaves the vision tower on its own kernel."""
    from hf_sp_trainer.attention.ulysses import UlyssesAttention, _text_only

    model = build_vlm("qwen2_vl")
    assert _text_only(model, "ulysses_sp") == {"text_config": "ulysses_sp", "vision_config": "sdpa"}
    block = model.model.visual.blocks[0].attn
    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(RuntimeError, match="not part of a text decoder"):
        UlyssesAttention(None, None, "sdpa").registered(block, q, q, q, None)


def test_only_proven_vlms_pass_the_checks() -> None:
    """Every image-text-to-text family is refused or can't build, except those this file's matrix proves exact; and
    every VLM base model SP accepts (``model.vlm.VERIFIED``) has cases in the matrix, ring cases too (every decoder
    here takes a ring: the selecting attentions by DSA's all-gather path)."""
    from hf_sp_trainer.model.vlm import VERIFIED, vlm_base
    from tests.multimodal_harness import FAMILIES, classify_vlms

    rows = classify_vlms()
    accepted = {cls for _, cls, status, _ in rows if status == "exact"}  # glmga's class is GLM-4.6V's
    if not CACHE_ARGUMENT:  # before 5.24: the matrix leaves these out; their default configs swap nothing (accepted)
        from tests.multimodal_harness import ALL_FAMILIES, CACHE_ARGUMENT_VLMS

        accepted -= {cls for family, cls in ALL_FAMILIES.items() if family in CACHE_ARGUMENT_VLMS}
    assert accepted == set(FAMILIES.values()), (accepted, set(FAMILIES.values()))
    ringed = {FAMILIES[c.family] for c in SP2 + SP4 if c.ring}
    assert accepted <= {FAMILIES[c.family] for c in SP2} and accepted <= ringed, accepted - ringed
    bases = {type(vlm_base(build_vlm(f))).__name__ for f in FAMILIES}  # Llama-4's VLM is its own base
    # before transformers 5.24 some VERIFIED bases are missing or refused (CACHE_ARGUMENT_VLMS)
    assert bases == set(VERIFIED) if CACHE_ARGUMENT else bases <= set(VERIFIED), (bases, VERIFIED)
    assert {t for t, _, s, _ in rows if s == "refused"} >= {"paligemma", "janus"}


@pytest.mark.dist
def test_glm5_next_video_spans_are_told_apart_on_the_whole_sequence() -> None:
    """GLM-5-Next's video frames are image tokens inside video start / end spans that a shard need not hold (the
    "videos" row: the sp-2 shard after the boundary continues a video whose start token is on the first): SP tells
    them apart on the whole sequence and merges each rank's rows itself. The hardest case, images and videos in one
    batch at Ulysses 2 x ring 2 (1.0e-5 in fp32 here: Kimi delta attention's ``A_log`` gradient, a sum over tokens
    with cancellation) is exact by ``tests/exactness.py``'s rule, its float64 run forced (``NEAR_THE_BAR``)."""
    from hf_sp_trainer import SPMultimodalCollator
    from hf_sp_trainer.model.vlm import span_marked_video
    from tests.multimodal_families_extra import VIDEO_SPAN

    model = build_vlm("glm5_next")
    assert span_marked_video(model) == VIDEO_SPAN
    assert all(span_marked_video(build_vlm(f)) is None for f in ("glm4v", "qwen2_vl", "ernie4_5_vl_moe"))
    row = SPMultimodalCollator(model)(make_examples(LAYOUTS["videos"], "glm5_next"))["input_ids"][0]
    second = row[len(row) // 2 :]
    assert VIDEO_SPAN[0] not in second[: second.tolist().index(VIDEO_SPAN[1])] and IMG in second
    case = Case("glm5_next", "mixed", ring=2)
    result = unwrap_results(run_distributed(4, run_matrix, [case], 4))[0][case.name]
    assert result["exact"] and result["float64"] is not None, result["verdict"]


@pytest.mark.parametrize("family", ["paligemma"])
def test_refused_vlms(family: str) -> None:
    """PaliGemma's bidirectional prefix mask depends on what the shard doesn't hold."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from hf_sp_trainer.multimodal import check_multimodal

    cls = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[family])
    with torch.device("meta"):
        model = cls(CONFIG_MAPPING[family]())
    with pytest.raises(ValueError, match="Use sp_size=1"):
        check_multimodal(model, 2)


def test_gemma3_checks_its_block_kernels() -> None:
    """Gemma3's images run on the block kernels, with or without a ring (4 heads: sp 8 is ulysses 4 x ring 2): a
    kernel without a log-sum-exp, or attention dropout, which those kernels lack, is refused before any collective."""
    from hf_sp_trainer.validate import validate_model_for_sp

    model = build_vlm("gemma3")
    assert validate_model_for_sp(model, 4) == (4, 1) and validate_model_for_sp(model, 8) == (4, 2)
    assert validate_model_for_sp(model, 4, ring_size=2) == (2, 2)
    with pytest.raises(ValueError, match=r"see their whole image.*log-sum-exp.*sp_attn_implementation"):
        validate_model_for_sp(model, 2, kernel="flex_attention")
    model.config.text_config.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"attention_dropout=0.1\); set it to 0"):
        validate_model_for_sp(model, 2)


@pytest.mark.dist
def test_image_blocks_are_needed() -> None:
    """Negative controls: the same Gemma3 / Gemma4 cases with the images' pairs ``p < j`` left out (causal) are far
    from the single-device result, as is the ring case with only those in a later key chunk left out (the blocks a
    causal ring skips), and Gemma4 with the pairs on its full-attention layers too."""
    from tests.multimodal_harness import run_matrix_without

    cases = [Case("gemma3", "mixed"), Case("gemma3", "mixed", ring=2), Case("gemma4", "mixed", ring=2)]
    got = unwrap_results(run_distributed(2, run_matrix_without, cases, 2))[0]
    expected = {"gemma3_mixed_causal", "gemma3_mixed_ring2_causal", "gemma3_mixed_ring2_next_chunk_skipped"}
    expected |= {"gemma4_mixed_ring2_causal", "gemma4_mixed_ring2_next_chunk_skipped", "gemma4_mixed_ring2_every_layer"}
    assert set(got) == expected, set(got)
    print({k: f"{v['error']:.2e}" for k, v in got.items()})
    assert min(r["error"] for r in got.values()) > 1e-2, got


# -- Llama-4 ---------------------------------------------------------------------------------------------------
def test_llama4_length_settings_act() -> None:
    """Negative controls for the Llama-4 cases: the reference (each document alone) moves far beyond the tolerance
    when its chunks (8), its NoPE temperature (floor 4) or both go back to transformers' defaults (8192: neither acts
    on these rows), so an SP run matching it at 1e-5 honours both."""
    from tests.multimodal_llama4 import llama4_reference_gaps

    for layout in ("mixed", "padded"):
        gaps = llama4_reference_gaps(layout)
        print(layout, {k: f"{v:.2e}" for k, v in gaps.items()})
        assert set(gaps) == {"chunk", "temperature", "both"} and min(gaps.values()) > 1e-2, (layout, gaps)


def test_llama4_layout_is_its_processors() -> None:
    """Llama-4's examples as its processor lays them out: ``<|image_start|>``, the tiles' rows (16 ``<|patch|>`` a
    tile, x / y separators) where an image has several tiles, ``<|image|>`` and the global tile's patches,
    ``<|image_end|>``; one 16-row tile of features per 16 placeholders."""
    from tests.multimodal_llama4 import IMAGE_END, IMAGE_START, IMAGE_TOKEN, TILE_X, TILE_Y, llama4_image

    ids, pixels = llama4_image(4, 6, torch.Generator().manual_seed(0))  # 2 x 2 tiles and the global one
    row = [IMG] * 16 + [TILE_X] + [IMG] * 16 + [TILE_Y]
    assert ids == [IMAGE_START, *row, *row, IMAGE_TOKEN, *[IMG] * 16, IMAGE_END], ids
    assert tuple(pixels.shape) == (5, 3, 16, 16)
    single, pixels = llama4_image(2, 2, torch.Generator().manual_seed(0))
    assert single == [IMAGE_START, IMAGE_TOKEN, *[IMG] * 16, IMAGE_END] and pixels.shape[0] == 1, single
    model = build_vlm("llama4")
    for example in make_examples(LAYOUTS["mixed"], "llama4"):
        if "pixel_values" in example:
            with torch.no_grad():
                rows = model.get_image_features(example["pixel_values"], return_dict=True).last_hidden_state
            assert rows.shape[0] * rows.shape[1] == int((example["input_ids"] == IMG).sum())


def test_llama4_forward_needs_the_tuple_path() -> None:
    """Contract: transformers' ``Llama4ForConditionalGeneration.forward`` fails on a dict output before 5.25 (its
    language model's output has no ``image_outputs``), on one device, so the matrix and the Trainer case run its
    tuple path (``tests/multimodal_llama4.py``), which every supported version runs; 5.25 fixed the dict path. When
    the oldest supported transformers has the fix, run Llama-4 through the dict path (drop ``config.return_dict =
    False`` and ``with_return_dict``)."""
    import transformers
    from packaging.version import Version

    from hf_sp_trainer.model.vlm import feature_field

    model = build_vlm("llama4")
    example = make_examples(LAYOUTS["padded"][:1], "llama4")[0]
    inputs = {"input_ids": example["input_ids"][None], "pixel_values": example["pixel_values"]}
    model.config.return_dict = True
    try:
        dict_path = model(**inputs).logits.shape[1] == example["input_ids"].numel()
    except AttributeError as error:  # 5.23 and 5.24
        assert "image_outputs" in str(error)
        dict_path = False
    assert dict_path or Version("5.23") <= Version(transformers.__version__) < Version("5.25")
    model.config.return_dict = False
    logits = model(**inputs, return_dict=True)[0]
    assert logits.shape == (1, example["input_ids"].numel(), model.config.text_config.vocab_size)
    encoded = model.get_image_features(example["pixel_values"], return_dict=True)  # what SP merges
    if Version(transformers.__version__) >= Version("5.25"):  # projected features in pooler_output, as other VLMs
        assert feature_field(encoded) == "pooler_output"
    else:  # no pooler: its forward projects the last hidden state after the merge
        assert feature_field(encoded) == "last_hidden_state" and encoded.pooler_output is None


# -- dots3-note ------------------------------------------------------------------------------------------------
@pytest.mark.dist  # in-process, but three VLM references (~20 s): off the unit tier's budget
def test_dots3_note_length_settings_act() -> None:
    """Negative controls for the dots3-note cases: the reference moves far beyond the tolerance when its DSA top-k (5)
    or its sliding window (7) is taken out of reach of the rows, so an SP run matching it at 1e-5 honours both."""
    from tests.multimodal_families_extra import dots3_note_reference_gaps

    for layout in ("mixed", "padded"):
        gaps = dots3_note_reference_gaps(layout)
        print(layout, {k: f"{v:.2e}" for k, v in gaps.items()})
        assert min(gaps.values()) > 1e-2, (layout, gaps)


@pytest.mark.dist  # in-process, but four VLM references: off the unit tier's budget, as dots3-note's
@pytest.mark.parametrize("family", ["mistral_large4", "minimax_m3_vl", "hy_v4_vl", "glm5_next"])
def test_selection_top_k_acts(family: str) -> None:
    """Negative control for the Mistral-Large-4 and HY-V4-VL (top-5 keys), MiniMax-M3-VL (top-2 blocks of 4) and
    GLM-5-Next (the best 2 pools of 4) cases: the reference moves far beyond the tolerance when the top-k is taken
    out of reach of the rows, so an SP run matching it at 1e-5 honours it."""
    from tests.multimodal_families_extra import selection_reference_gap

    for layout in ("images",) if family == "glm5_next" else ("mixed", "padded"):
        gap = selection_reference_gap(family, layout)
        print(family, layout, f"{gap:.2e}")
        assert gap > 1e-2, (family, layout, gap)


# -- ERNIE-4.5-VL and Qwen4-Exp (tests/multimodal_families_mrope.py) --------------------------------------------
@pytest.mark.dist  # in-process, but six VLM references: off the unit tier's budget, as dots3-note's
def test_mrope_family_settings_act() -> None:
    """Negative controls for the ERNIE-4.5-VL and Qwen4-Exp cases: the reference moves far beyond the tolerance when
    ERNIE-4.5-VL's moe_mm_token_type_ids are left out (every token to its text experts) and when Qwen4-Exp's QSA
    budget is taken out of reach of the rows, so SP runs matching them at 1e-5 route and select as the model does."""
    from tests.multimodal_families_mrope import qsa_reference_gap, vision_experts_gap

    for layout in ("mixed", "padded"):
        gaps = {"experts": vision_experts_gap(layout), "qsa": qsa_reference_gap(layout)}
        print(layout, {k: f"{v:.2e}" for k, v in gaps.items()})
        assert min(gaps.values()) > 1e-2, (layout, gaps)


def test_collator_packs_per_token_inputs_and_merged_frames() -> None:
    """ERNIE-4.5-VL: its processor's ``moe_mm_token_type_ids`` packed like ``input_ids`` (zeros for an example without
    them, a length mismatch refused; TRL's processor output carried by ``SPVisionSFTCollator``), a model not taking
    them gets none; its videos' placeholders counted with frames merged in pairs (``t * h * w / 4 / 2``), by the
    collator and by split media's units."""
    from hf_sp_trainer import SPMultimodalCollator
    from hf_sp_trainer.collators.multimodal import SPVisionSFTCollator
    from hf_sp_trainer.multimodal.media_split import media_layout

    model = build_vlm("ernie4_5_vl_moe")
    collator = SPMultimodalCollator(model)
    many = collator(make_examples(LAYOUTS["many"], "ernie4_5_vl_moe"))
    assert media_layout(model.model, "video", many, 5).features == [4, 1]  # (2, 4, 4) and (2, 2, 2) videos
    examples = make_examples(LAYOUTS["mixed"], "ernie4_5_vl_moe")
    whole = torch.cat([ex["moe_mm_token_type_ids"] for ex in examples])
    assert torch.equal(collator(examples)["moe_mm_token_type_ids"][0], whole) and whole.eq(2).any()
    rows = ("input_ids", "moe_mm_token_type_ids")  # a processor's batch of one: these [1, seq], the media as they are
    processed = [ex | {k: ex[k][None] for k in rows} | {"attention_mask": torch.ones(1, len(ex["input_ids"]))}
                 for ex in make_examples(LAYOUTS["padded"], "ernie4_5_vl_moe")]  # fmt: skip
    trl_like = SPVisionSFTCollator(lambda batch: batch[0] | {"labels": batch[0]["input_ids"]}, collator)
    carried = trl_like(processed)["moe_mm_token_type_ids"][0]
    assert torch.equal(carried, torch.cat([p["moe_mm_token_type_ids"][0] for p in processed])), carried
    n = len(examples[0]["input_ids"])
    del examples[0]["moe_mm_token_type_ids"]
    assert torch.equal(collator(examples)["moe_mm_token_type_ids"][0], torch.cat([torch.zeros(n).long(), whole[n:]]))
    examples[0]["moe_mm_token_type_ids"] = torch.zeros(n + 1)
    with pytest.raises(ValueError, match=f"{n} input_ids but {n + 1} moe_mm_token_type_ids"):
        collator(examples)
    video = {k: v for k, v in examples[2].items() if k != "moe_mm_token_type_ids"}  # a (2, 4, 4) video: 4 tokens
    video["input_ids"] = torch.cat([video["input_ids"], torch.tensor([121])])
    with pytest.raises(ValueError, match=r"5 video placeholder tokens but its video_grid_thw \[\[2, 4, 4\]\] gives 4"):
        collator([video])
    qwen = make_examples(LAYOUTS["mixed"], "qwen2_vl")
    assert "moe_mm_token_type_ids" not in SPMultimodalCollator(build_vlm("qwen2_vl"))(qwen)


# -- TRL's vision SFT format ------------------------------------------------------------------------------------
def _sft_job(sp_size: int, assistant_only: bool) -> dict:
    from tests.multimodal_harness import sft_vlm

    with tempfile.TemporaryDirectory() as out:
        return sft_vlm(sp_size, out, assistant_only=assistant_only)


@pytest.mark.dist
@pytest.mark.parametrize("assistant_only", [False, True], ids=["all", "assistant"])
def test_sp_sft_on_vision_conversations_matches_trl(assistant_only: bool) -> None:
    """``SPSFTTrainer`` on TRL's vision dataset format (``messages`` + ``images``, a processor as
    ``processing_class``; TRL's own processing and label masking per example, then one packed row) against
    ``trl.SFTTrainer`` on one process with its padded batches: per-step loss, grad_norm and the weights after three
    SGD steps (LLaVA; the loss on every token, or on the assistant's only)."""
    from tests.multimodal_harness import sft_vlm

    with tempfile.TemporaryDirectory() as out:
        ref = sft_vlm(1, out, assistant_only=assistant_only)
    got = unwrap_results(run_distributed(2, _sft_job, 2, assistant_only))[0]
    assert_exact(f"vision sft {assistant_only=}", trainer_diffs(got, ref, steps=3))


@pytest.mark.e2e
def test_hf_sp_sft_with_a_vlm_checkpoint_matches_trl(tmp_path) -> None:
    """``hf-sp-sft --num_processes 2 --sp_size 2`` given a VLM checkpoint directory (a tiny LLaVA and its processor,
    loaded as TRL loads a hub id) and a parquet file of TRL's vision conversations: per-step loss and grad_norm, and
    the saved weights, as ``trl.SFTTrainer`` on one process."""
    import json
    import os
    import subprocess
    import sys

    import transformers
    from datasets import Dataset

    from hf_sp_trainer.data.tiny_vlm import tiny_llava_processor, vision_conversations
    from tests.multimodal_harness import sft_vlm

    build_vlm("llava").save_pretrained(tmp_path / "vlm")
    tiny_llava_processor().save_pretrained(tmp_path / "vlm")
    Dataset.from_list(vision_conversations()).to_parquet(str(tmp_path / "vision.parquet"))
    out = tmp_path / "sp2"
    command = [
        os.path.join(os.path.dirname(sys.executable), "hf-sp-sft"), "--num_processes", "2", "--sp_size", "2",
        "--model_name_or_path", str(tmp_path / "vlm"), "--dataset_name", str(tmp_path / "vision.parquet"),
        "--max_steps", "3", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
        "--optim", "sgd", "--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--logging_steps", "1",
        "--report_to", "none", "--bf16", "false", "--dtype", "float32", "--save_strategy", "no", "--seed", "0",
        "--output_dir", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    got = [(e["loss"], e["grad_norm"]) for e in history if "grad_norm" in e]
    ref = sft_vlm(1, str(tmp_path / "ref"))
    saved = dict(transformers.LlavaForConditionalGeneration.from_pretrained(out).named_parameters())
    run = {"losses": [loss for loss, _ in got], "grad_norms": [norm for _, norm in got], "params": saved}
    assert_exact("hf-sp-sft vision", trainer_diffs(run, ref, steps=3))
