"""Kimi-K2.5, dots3-note, Mistral-Large-4, MiniMax-M3-VL, HY-V4-VL and GLM-5-Next in the multimodal matrix: their
tiny configs and their processors' media layouts.

All but HY-V4-VL have 1-D positions (no ``get_rope_index``); all merge one feature row per placeholder from
``image_grid_thw`` / ``video_grid_thw`` grids; their text decoders are those of the text family suite
(``tests/family_harness.py``'s tiny configs), with their length settings brought under the rows here.

- Kimi-K2.5 (``Kimi_K25ForConditionalGeneration``): a DeepSeek-V3 decoder (MLA, MoE after a dense first layer). Its
  tower takes ``[patches, 3, 2, 2]`` pixels; an image of ``h x w`` patches is ``h * w / 4`` placeholders (2 x 2
  merged). A video is chunks of ``TEMPORAL`` frames (its processor's ``temporal_patch_size``), each chunk a grid row
  ``[TEMPORAL, h, w]`` attended as one clip and mean-pooled over its frames to ``h * w / 4`` placeholders, laid out
  ``<timestamp> <media_begin> <video>*n <media_end>``; a layout's video of ``t`` is ``t`` chunks.
- dots3-note (``Dots3NoteForConditionalGeneration``): a ``dots3_note_text`` decoder: DeepSeek sparse attention (an
  indexer's top-``INDEX_TOPK`` keys per query, under the documents' lengths) on its indexed layers, sliding-window
  MLA (window ``WINDOW``, crossing the shards) on the other, MoE; a Qwen2-VL-like tower with MoE blocks, ``[patches,
  12]`` pixel rows, ``t * h * w / 4`` placeholders per grid. Its audio tower is built but not fed (SP refuses audio).
  DSA runs under Ulysses and with a ring (the all-gather path: ``attention/dsa.ring_gather``).

- MiniMax-M3-VL (``MiniMaxM3SparseForConditionalGeneration``): a ``minimax_m3_vl_text`` decoder with block-sparse
  selection (``BLOCK``, under the documents' lengths; Ulysses and ring); a Conv3d tower, one frame per temporal patch
  here, so its pixel rows and placeholders are dots3-note's.
- HY-V4-VL (``HYV4VLForConditionalGeneration``): a ``hy_v4_vl_text`` decoder, HY-V4's (MLA, DSA top-``INDEX_TOPK``,
  learned sinks, hyper-connections, a layer reusing the first's top-k; a ring too) with interleaved mrope positions
  (its own ``get_rope_index``); its tower takes dots3-note's ``[patches, 12]`` pixel rows (one frame per grid row,
  videos through the same path) and merges each frame 2 x 2 with a newline feature ending every merged row:
  ``t * h/2 * (w/2 + 1)`` placeholders.

- GLM-5-Next (``Glm5NextForConditionalGeneration``): a ``glm5_next_text`` decoder of KDA layers and pooled DSA layers
  (its indexer scores pools of ``index_kpool`` keys, counted under SP from each document's start: transformers counts
  them from the row's; ``attention/pooled_dsa.py``), NoPE, hyper-connections, MoE; dots3-note's pixel rows and
  placeholders. Its video frames are image tokens told apart by the video start / end tokens around them
  (``VIDEO_SPAN``), as its processor lays them out: ``<video_start>``, per frame ``<image_start> <image>*
  <image_end> <timestamp>``, ``<video_end>``; a shard need not hold a span's ends, so SP tells them apart on the
  whole sequence and merges each rank's rows itself (``multimodal/features.py``).
"""

from __future__ import annotations

import torch

from hf_sp_trainer.data import tiny_vlm

IMG, VID, VSTART, VEND, AUDIO = tiny_vlm.IMAGE_TOKEN_ID, 121, 122, 123, 126  # the harness's token ids
TEMPORAL = 2  # Kimi-K2.5: frames per video chunk
INDEX_TOPK = 5  # dots3-note: keys per query picked by its DSA indexer (documents of 7-29 tokens)
WINDOW = 7  # dots3-note: its sliding layers' window

FAMILIES = {
    "kimi_k25": "Kimi_K25ForConditionalGeneration",  # a DeepSeek-V3 decoder (MLA, MoE); videos pooled per chunk
    "dots3_note": "Dots3NoteForConditionalGeneration",  # DSA + sliding-window MLA, MoE; a tower with MoE blocks
    "minimax_m3_vl": "MiniMaxM3SparseForConditionalGeneration",  # block-sparse selection, MoE
}
# Pixtral's image layout (the harness's ``PIXTRAL``: 4h x 4w pixels, h rows of w placeholders, [IMG_BREAK] rows)
PIXTRAL_FAMILIES = {"mistral_large4": "MistralLarge4ForConditionalGeneration"}  # DSA (positional), MoE
FAMILIES["hy_v4_vl"] = "HYV4VLForConditionalGeneration"  # HY-V4's DSA with sinks and hyper-connections, mrope
FAMILIES["glm5_next"] = "Glm5NextForConditionalGeneration"  # pooled DSA (NoPE) + KDA, hyper-connections, MoE
SPAN_VIDEOS = ("glm5_next",)  # video frames at the image token inside VIDEO_SPAN
BLOCK = dict(index_block_size=4, index_topk_blocks=2, index_local_blocks=1)  # MiniMax-M3: top-2 blocks of 4 keys


def kimi_k25_config():
    from transformers import Kimi_K25Config

    from tests.family_harness import tiny_config

    vision = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=4, num_attention_heads=4,
                  num_hidden_layers=2, hidden_size=32, intermediate_size=64, merge_kernel_size=[2, 2])  # fmt: skip
    return Kimi_K25Config(text_config=tiny_config("deepseek_v3").to_dict(), vision_config=vision,
                          projection_hidden_size=32, image_token_id=IMG, video_token_id=VID,
                          vision_start_token_id=VSTART, vision_end_token_id=VEND)  # fmt: skip


def dots3_note_config(topk: int = INDEX_TOPK, window: int = WINDOW):
    from transformers import Dots3NoteConfig

    from tests.family_harness import tiny_config

    text = tiny_config("dots3_note_text").to_dict()
    for key in ("rope_parameters", "per_layer_config"):  # derived again from the small sliding layer below
        text.pop(key, None)
    sliding = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, head_dim=16,
                   qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip
    layers = text["layer_types"]
    assert "sliding_attention" in layers and "indexed_attention" in layers, layers
    text |= {"index_topk": topk, "sliding_window": window}
    text["per_layer_config"] = {i: sliding for i, kind in enumerate(layers) if kind == "sliding_attention"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=2,
                  spatial_merge_size=2, adapter_in_dim=32, adapter_out_dim=64, adapter_merge_size=2,
                  pyramid_num_routed=[-1, 4], num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    audio = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, feature_size=16,
                 downsample_hidden_size=16, adapter_input_size=32, adapter_out_dim=64)  # fmt: skip
    return Dots3NoteConfig(text_config=text, vision_config=vision, audio_config=audio, image_token_id=IMG,
                           video_token_id=VID, audio_token_id=AUDIO)  # fmt: skip


def mistral_large4_config(topk: int = INDEX_TOPK):
    """Mistral-Large-4: a Pixtral tower, its patch merger, a ``mistral_large4_text`` decoder of 4 DSA layers (top-
    ``topk`` keys per query, under the documents' lengths; queries scaled by their document positions): RoPE with its
    own indexer storing its latent kv, RoPE reusing both (``"shared"`` top-k), NoPE with its own, RoPE reusing the
    first layer's kv with an indexer of its own; MoE after a dense first layer."""
    from transformers import MistralLarge4Config

    from tests.family_harness import tiny_config

    text = tiny_config("mistral_large4_text").to_dict()
    text |= {"num_hidden_layers": 4, "index_topk": topk, "index_n_heads": 16, "pad_token_id": 0}
    text |= {"no_rope_layers": [1, 1, 0, 1], "indexer_types": ["full", "shared", "full", "full"]}
    text |= {"kv_source_layers": [0, 0, 2, 0], "layer_types": ["indexed_attention"] * 4}
    text["mlp_layer_types"] = ["dense"] + ["sparse"] * 3
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, head_dim=8, image_size=16, patch_size=2)  # fmt: skip
    return MistralLarge4Config(vision_config=vision, text_config=text, image_token_index=IMG, spatial_merge_size=2)


def minimax_m3_vl_config(topk_blocks: int = BLOCK["index_topk_blocks"]):
    """MiniMax-M3-VL: its Conv3d tower (one frame per temporal patch: ``[patches, 12]`` pixel rows, ``t * h * w / 4``
    placeholders per grid, videos through the same tower), a ``minimax_m3_vl_text`` decoder of a full-attention layer
    and a block-sparse one (top-``topk_blocks`` blocks of 4 keys plus the local one per KV group, under the
    documents' lengths), MoE."""
    from transformers import MiniMaxM3VLConfig

    from tests.family_harness import tiny_config

    text = tiny_config("minimax_m3_vl_text").to_dict() | BLOCK | {"index_topk_blocks": topk_blocks}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=2, image_size=16)  # fmt: skip
    return MiniMaxM3VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                             projector_hidden_size=32)  # fmt: skip


def hy_v4_vl_config(topk: int = INDEX_TOPK):
    """HY-V4-VL: the text family suite's HY-V4 decoder (MLA; DSA, top-``topk`` keys per query, on layers 0 and 2,
    layer 1 reusing layer 0's; learned sinks, drawn large by the harness; 4 hyper-connection streams; MoE after a
    dense layer) with mrope over its 4 rotary frequencies (t, h, w, t), and a 2-layer tower projecting to its width."""
    from transformers import HYV4VLConfig

    from tests.family_harness import tiny_config

    text = {k: v for k, v in tiny_config("hy_v4").to_dict().items() if k not in ("model_type", "transformers_version")}
    text |= {"index_topk": topk, "output_router_logits": False}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=2,
                  spatial_merge_size=2, max_image_size=16, out_hidden_size=64)  # fmt: skip
    return HYV4VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID)


POOL = dict(index_topk=8, index_kpool=4)  # GLM-5-Next: the best 2 pools of 4 keys per query, and its own pool's tail
VIDEO_SPAN = (126, 127)  # GLM-5-Next's <|begin_of_video|> / <|end_of_video|> (its video frames: image tokens)


def glm5_next_config(topk: int = POOL["index_topk"]):
    """GLM-5-Next: a ``glm5_next_text`` decoder of Kimi delta attention (KDA) layers and pooled DSA layers (NoPE: no
    positional embedding; the best ``topk / 4`` pools of 4 keys, counted from each document's start, plus the
    query's own incomplete pool), the second DSA layer reusing the first's top-k; 2 hyper-connection streams; MoE
    after a dense layer; a Qwen2-VL-like tower (one frame per temporal patch: ``[patches, 12]`` pixel rows,
    ``t * h * w / 4`` placeholders per grid)."""
    from transformers import Glm5NextConfig

    text = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=0,
        qk_nope_head_dim=16, v_head_dim=16, index_n_heads=8, index_head_dim=16, index_kpool=POOL["index_kpool"],
        index_topk=topk, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, linear_head_dim=16,
        linear_num_heads=4, hc_mult=2, pad_token_id=0, max_position_embeddings=512,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    )  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=1, image_size=16, out_hidden_size=64)  # fmt: skip
    vision["projection_intermediate_size"] = 64
    return Glm5NextConfig(
        text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID, image_start_token_id=VSTART,
        image_end_token_id=VEND, video_start_token_id=VIDEO_SPAN[0], video_end_token_id=VIDEO_SPAN[1],
    )  # fmt: skip


CONFIGS = {"kimi_k25": kimi_k25_config, "dots3_note": dots3_note_config, "mistral_large4": mistral_large4_config}
CONFIGS |= {"minimax_m3_vl": minimax_m3_vl_config, "hy_v4_vl": hy_v4_vl_config, "glm5_next": glm5_next_config}


def extra_medium(
    family: str, modality: str, thw: tuple[int, int, int], g: torch.Generator
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """One image / video of a layout (``(t, h, w)`` patches) as the family's processor gives it: its tokens, its
    pixel values and its grid rows."""
    t, h, w = thw
    token = IMG if modality == "image" else VID
    if family == "kimi_k25":
        if modality == "image":
            ids = [VSTART] + [IMG] * (h * w // 4) + [VEND]
            return ids, torch.randn(h * w, 3, 2, 2, generator=g), torch.tensor([[1, h, w]])
        ids = []
        for _ in range(t):  # t chunks of TEMPORAL frames, each its own timestamp and run
            ids += [int(torch.randint(3, IMG, (1,), generator=g)), VSTART] + [VID] * (h * w // 4) + [VEND]
        pixels = torch.randn(t * TEMPORAL * h * w, 3, 2, 2, generator=g)
        return ids, pixels, torch.tensor([[TEMPORAL, h, w]] * t)
    if family in SPAN_VIDEOS and modality == "video":  # GLM-5-Next: frames of image tokens inside the span
        ids = [VIDEO_SPAN[0]]
        for _ in range(t):
            ids += [VSTART] + [IMG] * (h * w // 4) + [VEND, int(torch.randint(3, IMG, (1,), generator=g))]
        return [*ids, VIDEO_SPAN[1]], torch.randn(t * h * w, 3 * 2 * 2, generator=g), torch.tensor([[t, h, w]])
    newline = family == "hy_v4_vl"  # HY-V4-VL: each merged row of a frame ends with a newline placeholder
    ids = [VSTART] + [token] * (t * (h // 2) * (w // 2 + newline)) + [VEND]
    return ids, torch.randn(t * h * w, 3 * 2 * 2, generator=g), torch.tensor([[t, h, w]])


def dots3_note_reference_gaps(layout: str) -> dict[str, float]:
    """Negative controls: how far the reference (each document alone) moves when dots3-note's top-k or its window is
    taken out of reach of the rows (10**6: every key selected, no window)."""
    from tests.multimodal_harness import LAYOUTS, _instantiate_vlm, make_examples, reference, worst_error

    examples = make_examples(LAYOUTS[layout], "dots3_note")
    ref = reference(_instantiate_vlm("dots3_note", dots3_note_config(), 0), examples)
    out = {}
    for name, kwargs in {"index_topk": {"topk": 10**6}, "sliding_window": {"window": 10**6}}.items():
        other = reference(_instantiate_vlm("dots3_note", dots3_note_config(**kwargs), 0), examples)
        out[name] = worst_error(ref, other)[0]
    return out


def selection_reference_gap(family: str, layout: str) -> float:
    """Negative control: how far the reference (each document alone) moves when the family's top-k (Mistral-Large-4's
    and HY-V4-VL's keys, MiniMax-M3-VL's blocks) is taken out of reach of the rows (10**6: everything selected)."""
    from tests.multimodal_harness import LAYOUTS, _instantiate_vlm, make_examples, reference, worst_error

    examples = make_examples(LAYOUTS[layout], family)
    configs = (CONFIGS[family](), CONFIGS[family](10**6))
    ref, every = (reference(_instantiate_vlm(family, config, 0), examples) for config in configs)
    return worst_error(ref, every)[0]
