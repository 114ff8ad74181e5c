"""Tiny vision-language models and packed multimodal rows, for the SP-vs-each-document-alone checks.

A case is a list of documents; a document is text with images / videos placed by the family's own conventions
(Qwen-VL: ``<vision_start> <image>*n <vision_end>`` with ``n = t*h*w / merge**2`` and patch rows of
``3 * temporal * patch**2`` values). The reference runs every document alone through the model's own forward (its
own positions, its own merge) and sums the token losses; SP packs them with ``SPMultimodalCollator``, shards the
row and sums each rank's token losses and gradients over the SP group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import transformers

from hf_sp_trainer.data import tiny_vlm
from hf_sp_trainer.data.tiny_vlm import tiny_llava_config, tiny_llava_processor, vision_conversations
from hf_sp_trainer.model.vlm import vlm_base
from tests.exactness import float64_scope, inject_error, judge, widened
from tests.harness import worst_error
from tests.multimodal_families_extra import CONFIGS as EXTRA_CONFIGS
from tests.multimodal_families_extra import FAMILIES as EXTRA_FAMILIES
from tests.multimodal_families_extra import PIXTRAL_FAMILIES, SPAN_VIDEOS, extra_medium
from tests.multimodal_families_mrope import CONFIGS as MROPE_CONFIGS
from tests.multimodal_families_mrope import FAMILIES as MROPE_FAMILIES
from tests.multimodal_families_mrope import FRAMES_APART, OWN_LAYOUT, mrope_medium, mrope_token_types
from tests.multimodal_llama4 import forward_logits, llama4_config, llama4_image, with_return_dict
from tests.upstream import CACHE_ARGUMENT

VOCAB = tiny_vlm.VOCAB
IMG, VID, VSTART, VEND, VSTART2, VEND2 = tiny_vlm.IMAGE_TOKEN_ID, 121, 122, 123, 124, 125
PATCH, TEMPORAL, MERGE = 2, 2, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH


@dataclass
class Doc:
    text: tuple[int, ...]  # text tokens before / between / after the media: len(media) + 1 pieces' lengths
    media: tuple[tuple[str, tuple[int, int, int]], ...] = ()  # ("image" | "video", (t, h, w)) in token order
    extra: dict = field(default_factory=dict)


FAMILIES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",  # hybrid: Gated DeltaNet + attention layers
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",  # the same hybrid, every MLP a routed MoE
    "glm4v": "Glm4vForConditionalGeneration",  # its own mrope rules: video frames apart, timestamps between
    "glm4v_moe": "Glm4vMoeForConditionalGeneration",
    "glm46v": "Glm46VForConditionalGeneration",
    "glm_ocr": "GlmOcrForConditionalGeneration",  # GLM-4V's merge and positions: its own tower (no position table)
    "paddleocr_vl": "PaddleOCRVLForConditionalGeneration",  # Qwen2-VL's positions: a NaViT tower, an ERNIE decoder
    "llava": "LlavaForConditionalGeneration",  # 1-D positions: a CLIP tower and a Llama decoder
    "vipllava": "VipLlavaForConditionalGeneration",  # LLaVA with several tower layers' features, layer-normed
    "video_llava": "VideoLlavaForConditionalGeneration",  # LLaVA, a tower each for images and videos (CLS kept)
    "internvl": "InternVLForConditionalGeneration",  # 1-D positions: tiles, pixel-shuffled, a Qwen2 decoder
    "qianfan_ocr": "QianfanOCRForConditionalGeneration",  # InternVL with drop-path tower layers, a Qwen3 decoder
    "llava_next": "LlavaNextForConditionalGeneration",  # any-resolution tiles, unpadded, a newline feature per row
    "llava_next_video": "LlavaNextVideoForConditionalGeneration",  # LLaVA-Next's images; videos pooled per frame
    "mistral3": "Mistral3ForConditionalGeneration",  # Pixtral: images of any size, padded; [IMG_BREAK] per row
    "lfm2_vl": "Lfm2VlForConditionalGeneration",  # SigLIP2 NaFlex patches + an LFM2 decoder (short convs: mixers/)
    "gemma3": "Gemma3ForConditionalGeneration",  # image tokens see their whole image (sliding layers too): Ulysses
    "aya_vision": "AyaVisionForConditionalGeneration",  # SigLIP, pixel-shuffled, a Cohere2 decoder (sliding layers)
    "cohere2_vision": "Cohere2VisionForConditionalGeneration",  # the same shape, its own projector
    "lighton_ocr": "LightOnOcrForConditionalGeneration",  # Pixtral (images of any size) + a Qwen3 decoder
    "idefics3": "Idefics3ForConditionalGeneration",  # its decoder is text_model; pixel_values [b, images, 3, h, w]
    "smolvlm": "SmolVLMForConditionalGeneration",
    "idefics2": "Idefics2ForConditionalGeneration",  # a perceiver resampler (16 latents) + a Mistral decoder
    "got_ocr2": "GotOcr2ForConditionalGeneration",  # a SAM tower (windowed, relative positions), strided convs, Qwen2
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",  # LLaVA-Next's tiles, but not in multi-image examples
    # Gemma4: per-layer head sizes, per-layer embeddings, shared kv; image / video tokens see their whole image (a
    # frame) on the sliding layers ("vision" mode), or causal throughout (gemma4_causal, as its smaller models)
    "gemma4": "Gemma4ForConditionalGeneration",
    "gemma4_causal": "Gemma4ForConditionalGeneration",
    # Llama-4: tiles, pixel-shuffled; chunked attention and a NoPE temperature in its decoder (multimodal_llama4.py)
    "llama4": "Llama4ForConditionalGeneration",
    **EXTRA_FAMILIES,  # Kimi-K2.5 and dots3-note: tests/multimodal_families_extra.py
    **PIXTRAL_FAMILIES,  # Mistral-Large-4: Pixtral's images, a DSA decoder (tests/multimodal_families_extra.py)
    **MROPE_FAMILIES,  # ERNIE-4.5-VL and Qwen4-Exp: tests/multimodal_families_mrope.py
}
# VLMs whose decoders' SP versions take the `cache` argument (transformers >= 5.24: selection swaps, token history):
# refused before it, so not in the matrix there
CACHE_ARGUMENT_VLMS = {"dots3_note", "minimax_m3_vl", "mistral_large4", "hy_v4_vl", "glm5_next", "qwen4_exp"}
ALL_FAMILIES = FAMILIES  # the families this harness knows, installed or not
FAMILIES = {
    family: cls
    for family, cls in ALL_FAMILIES.items()
    if hasattr(transformers, cls) and (CACHE_ARGUMENT or family not in CACHE_ARGUMENT_VLMS)
}  # the families of the installed transformers
# VLMs whose fp32 round-off reaches ``EXACT`` on some host (their hyper-connection heads, as HY-V4's): judged with
# their float64 run on every host (``exactness.judge``'s ``force``)
NEAR_THE_BAR = {"hy_v4_vl", "glm5_next"}
GEMMA4 = ("gemma4", "gemma4_causal")  # h x w patches of 2 x 2 pixels (positions, -1 = padding), pooled 2 x 2
PIXTRAL = ("mistral3", "lighton_ocr", *PIXTRAL_FAMILIES)  # images of any size, [IMG_BREAK] rows
SHUFFLED = ("aya_vision", "cohere2_vision")  # 16 x 16 pixels, 2 x 2 patches, pixel-shuffled by 2: 16 placeholders
IDEFICS = ("idefics3", "smolvlm", "idefics2")  # the same tower shape, images per example in a batch dim of their own
TILED = ("llava_next", "llava_onevision", "llava_next_video")  # any-resolution tiles, a newline feature per row
LLAVA_LIKE = ("llava", "vipllava", "video_llava")  # one 8 x 8 image: 16 placeholders (the CLS feature dropped)
GLM = ("glm4v", "glm4v_moe", "glm46v", "glm_ocr")  # video frames at the image token, timestamps between frames
VIDEO_FRAMES = ("video_llava", "llava_next_video")  # videos of 8 x 8 frames, [videos, frames, 3, 8, 8]
INTERNVL = ("internvl", "qianfan_ocr")  # 16 x 16 tiles, pixel-shuffled: 16 placeholders a tile
ONE_D = (*LLAVA_LIKE, *INTERNVL, *TILED, "lfm2_vl", "gemma3", "got_ocr2", *PIXTRAL, *SHUFFLED, *IDEFICS)  # 1-D
GEMMA3_IMAGE = 16  # a SigLIP tower on 16 x 16 pixels, 2 x 2 patches, average-pooled to 4 x 4 = 16 placeholders
IMG_BREAK, IMG_END = 124, 125  # Mistral3's row-break and end tokens (text tokens, no features)
LLAVA_IMAGE, LLAVA_PATCH = tiny_vlm.IMAGE_SIZE, tiny_vlm.PATCH  # the package's tiny LLaVA: 16 placeholders an image


INTERNVL_TILE = 16  # 64 patches of 2 x 2, pixel-shuffled by 0.5: 16 placeholders per tile


def internvl_config(family: str = "internvl"):
    """InternVL (a Qwen2 decoder) or Qianfan-OCR (the same model, drop path in the tower, a Qwen3 decoder)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=[INTERNVL_TILE, INTERNVL_TILE],
        patch_size=[2, 2],
    )
    text = dict(tiny_vlm.TINY_TEXT, model_type="qwen2")
    if family == "qianfan_ocr":
        text |= {"model_type": "qwen3", "head_dim": 16}
    return CONFIG_MAPPING[family](vision_config=vision, text_config=text, image_token_id=IMG, image_seq_length=16)


def gemma3_config():
    """Gemma3 with a sliding window (12) shorter than an image (16 tokens), so it cuts through images."""
    from transformers import Gemma3Config

    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=GEMMA3_IMAGE, patch_size=2)  # fmt: skip
    text = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                query_pre_attn_scalar=16, sliding_window=12, layer_types=["sliding_attention", "full_attention"],
                pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=16, image_token_index=IMG,
                        boi_token_index=VSTART, eoi_token_index=VEND)  # fmt: skip


GEMMA4_PATCHES = 64  # the processor pads every image / frame to max_soft_tokens x k**2 patches (16 x 4 here)


def gemma4_config(family: str = "gemma4"):
    """Gemma4 with a sliding window (5) shorter than an image, two full-attention layers of another head size, two
    layers reusing earlier layers' k/v, per-layer embeddings; no audio tower."""
    from transformers import Gemma4Config

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        patch_size=2,
        pooling_kernel_size=2,
        position_embedding_size=16,
    )
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=5,
                layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, use_bidirectional_attention="vision" if family == "gemma4" else None)  # fmt: skip
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=IMG,
                        video_token_id=VID, boi_token_id=VSTART, eoi_token_id=VEND, audio_token_id=126,
                        boa_token_id=VSTART2, eoa_token_index=127)  # fmt: skip


def gemma4_patches(h: int, w: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One image / frame of h x w patches as Gemma4's processor gives it: ``[GEMMA4_PATCHES, 12]`` pixel rows and
    ``[GEMMA4_PATCHES, 2]`` (x, y) positions, padding patches zero at -1."""
    pixels = torch.zeros(GEMMA4_PATCHES, 3 * PATCH * PATCH)
    pixels[: h * w] = torch.rand(h * w, 3 * PATCH * PATCH, generator=g)
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    positions = torch.full((GEMMA4_PATCHES, 2), -1)
    positions[: h * w] = torch.stack([xs.flatten(), ys.flatten()], -1)
    return pixels, positions


def shuffled_config(family: str):
    """Aya Vision / Cohere2-Vision: a SigLIP tower, pixel shuffle by 2, a Cohere2 decoder with a sliding layer."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=16, patch_size=2)  # fmt: skip
    text = dict(tiny_vlm.TINY_TEXT, model_type="cohere2", sliding_window=12,
                layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    token = {"image_token_index" if family == "aya_vision" else "image_token_id": IMG}
    config = CONFIG_MAPPING[family](vision_config=vision, text_config=text, downsample_factor=2, **token)
    config.alignment_intermediate_size = 64
    return config


def idefics_config(family: str):
    """Idefics3 / SmolVLM: a SigLIP-like tower on 16 x 16 pixels, pixel shuffle by 2, a Llama decoder; Idefics2: the
    same tower, a perceiver resampler to 16 latents, a Mistral decoder."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    vision = dict(model_type=f"{family}_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=16, patch_size=2)  # fmt: skip
    text = dict(tiny_vlm.TINY_TEXT, model_type="mistral" if family == "idefics2" else "llama")
    if family == "idefics2":  # the perceiver resamples every image to 16 latents
        perceiver = dict(hidden_size=64, rms_norm_eps=1e-6, resampler_n_latents=16, resampler_depth=2,
                         resampler_n_heads=2, resampler_head_dim=16, num_key_value_heads=1)  # fmt: skip
        config = CONFIG_MAPPING[family](vision_config=vision, text_config=text, perceiver_config=perceiver,
                                        image_token_id=IMG)  # fmt: skip
    else:
        config = CONFIG_MAPPING[family](vision_config=vision, text_config=text, scale_factor=2, image_token_id=IMG)
    config.pad_token_id = 0  # the default (128002) is outside the tiny vocabulary: SP pads with it
    return config


def lighton_ocr_config():
    from transformers import LightOnOcrConfig

    base = mistral3_config()
    text = dict(tiny_vlm.TINY_TEXT, model_type="qwen3", head_dim=16)
    return LightOnOcrConfig(vision_config=base.vision_config.to_dict(), text_config=text, image_token_id=IMG)


def got_ocr2_config():
    """GOT-OCR2: a SAM tower on 16 x 16 pixels (1 x 1 patches, windows of 4, one global layer), two stride-2 convs to
    4 x 4 = 16 placeholders, a Qwen2 decoder."""
    from transformers import GotOcr2Config

    vision = dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=1, window_size=4, global_attn_indexes=[1], mlp_dim=64)  # fmt: skip
    text = dict(tiny_vlm.TINY_TEXT, model_type="qwen2")
    return GotOcr2Config(vision_config=vision, text_config=text, image_token_index=IMG, image_seq_length=16)


def placeholders_per_image(family: str) -> int:
    if family in ("gemma3", "got_ocr2", *SHUFFLED, *IDEFICS):
        return 16
    return (LLAVA_IMAGE // LLAVA_PATCH) ** 2 if family in LLAVA_LIKE else (INTERNVL_TILE // 2) ** 2 // 4


def placeholders_per_frame(family: str) -> int:
    """Video-LLaVA: every patch and the CLS feature; LLaVA-Next-Video: the patches average-pooled by 2."""
    patches = (LLAVA_IMAGE // LLAVA_PATCH) ** 2
    return patches + 1 if family == "video_llava" else patches // 4


def llava_like_config(family: str):
    """The package's tiny LLaVA as VipLLaVA (two tower layers' features) or Video-LLaVA (its own video tower)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    base = tiny_llava_config()
    parts = dict(vision_config=base.vision_config.to_dict(), text_config=base.text_config.to_dict())
    if family == "vipllava":
        return CONFIG_MAPPING[family](**parts, image_token_index=IMG, vision_feature_layer=[-2, -1])
    return CONFIG_MAPPING[family](**parts, image_token_index=IMG, video_token_index=VID, vision_feature_layer=-1)


def llava_next_video_config():
    from transformers import LlavaNextVideoConfig

    base = tiny_llava_config()
    return LlavaNextVideoConfig(
        vision_config=base.vision_config.to_dict(), text_config=base.text_config.to_dict(), image_token_index=IMG,
        video_token_index=VID, image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1,
    )  # fmt: skip


def paddleocr_vl_config():
    """PaddleOCR-VL: a NaViT tower (2 x 2 patches, a 4 x 4 position table resampled per image), its projector
    merging 2 x 2 patches, an ERNIE-4.5 decoder with Qwen2-VL's multimodal rope."""
    from transformers import PaddleOCRVLConfig

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=8,
                  patch_size=PATCH, spatial_merge_size=MERGE)  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(tiny_vlm.TINY_TEXT, head_dim=16, rope_parameters=rope)
    return PaddleOCRVLConfig(
        vision_config=vision, text_config=text, image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
    )  # fmt: skip


PINPOINTS = [[8, 16], [16, 8], [16, 16]]  # LLaVA-Next: a base 8x8 view plus these tilings of 8x8 tiles


def llava_next_config():
    from transformers import LlavaNextConfig

    base = tiny_llava_config()
    config = LlavaNextConfig(
        vision_config=base.vision_config.to_dict(),
        text_config=base.text_config.to_dict(),
        image_token_index=IMG,
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-1,
    )
    return config


def llava_onevision_config():
    from transformers import LlavaOnevisionConfig

    base = tiny_llava_config()
    return LlavaOnevisionConfig(
        vision_config=base.vision_config.to_dict(), text_config=base.text_config.to_dict(), image_token_index=IMG,
        image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1, vision_aspect_ratio="anyres_max_9",
        vision_feature_select_strategy="default",
    )  # fmt: skip


def mistral3_config():
    from transformers import Mistral3Config

    base = tiny_llava_config()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                  image_size=16, patch_size=2)  # fmt: skip
    text = base.text_config.to_dict() | {"model_type": "mistral", "head_dim": 16}
    return Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMG, spatial_merge_size=2)


def lfm2_vl_config():
    from transformers import Lfm2VlConfig

    vision = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, patch_size=2, num_patches=64)  # fmt: skip
    text = dict(model_type="lfm2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=IMG, projector_hidden_size=64)


_LLAVA_NEXT = {}


def llava_next_image(
    size: tuple[int, int], g: torch.Generator, family: str = "llava_next", images: int = 1
) -> tuple[torch.Tensor, int]:
    """An image of ``size`` pixels as LLaVA-Next's processor gives it (the base view and its tiles, ``[patches, 3,
    8, 8]``) and its placeholder count, read from the model's own ``get_image_features`` (LLaVA-OneVision: in an
    example of several ``images`` only the base view is encoded)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    patches = image_size_to_num_patches(size, PINPOINTS, LLAVA_IMAGE)
    pixels = torch.randn(patches, 3, LLAVA_IMAGE, LLAVA_IMAGE, generator=g)
    if family not in _LLAVA_NEXT:
        _LLAVA_NEXT[family] = build_vlm(family)
    extra = {"batch_num_images": torch.tensor([images])} if family == "llava_onevision" else {}
    with torch.no_grad():
        rows = _LLAVA_NEXT[family].model.get_image_features(pixels[None], torch.tensor([size]), **extra).pooler_output
    return pixels, sum(r.shape[0] for r in rows)


def qwen_vl_config(family: str = "qwen2_vl", layers: int = 2):
    """A tiny random-init config of a Qwen-VL family (``FAMILIES``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        depth=2,
        hidden_size=32 if family != "qwen2_vl" else 64,
        num_heads=4,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        in_channels=3,
    )
    if family == "qwen2_vl":
        vision |= {"embed_dim": 32}
    elif family in GLM:  # GLM-4.1V, GLM-4.5V (MoE), GLM-4.6V, GLM-OCR
        text |= {"head_dim": 16}
        if family == "glm4v_moe":
            text |= {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
            text |= {"first_k_dense_replace": 1, "n_shared_experts": 1}
            text["rope_parameters"] |= {"partial_rotary_factor": 1.0}
        vision |= {"intermediate_size": 64, "out_hidden_size": 64, "image_size": 8}
        starts = dict(image_start_token_id=VSTART, image_end_token_id=VEND)
        starts |= dict(video_start_token_id=VSTART2, video_end_token_id=VEND2)
        return CONFIG_MAPPING[family](
            text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID, **starts
        )
    elif family.startswith("qwen3_5"):  # Qwen3.5 (MoE: every layer's MLP routed, a shared expert beside)
        text |= {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"]}
        text |= {"linear_num_key_heads": 2, "linear_num_value_heads": 4}
        text |= {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
        text["rope_parameters"] |= {"mrope_interleaved": True, "partial_rotary_factor": 1.0}
        vision |= {"intermediate_size": 64, "out_hidden_size": 64, "num_position_embeddings": 16}
        if family == "qwen3_5_moe":
            text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
            text |= {"shared_expert_intermediate_size": 32}
    elif family.startswith("qwen3"):  # deepstack: features of both vision blocks added after text layers 0 and 1
        text |= {"head_dim": 16}
        text["rope_parameters"] |= {"mrope_interleaved": True}
        vision |= {"intermediate_size": 64, "out_hidden_size": 64, "deepstack_visual_indexes": [0, 1]}
        vision |= {"num_position_embeddings": 16}
        if family.endswith("moe"):
            text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}
    else:  # Qwen2.5-VL: windowed vision blocks, out_hidden_size the text width
        vision |= {"intermediate_size": 64, "out_hidden_size": 64, "window_size": 8, "fullatt_block_indexes": [1]}
    return CONFIG_MAPPING[family](
        text_config=text,
        vision_config=vision,
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
    )


def build_vlm(family: str = "qwen2_vl", seed: int = 0, crossed: bool = False):
    """The family's tiny VLM; ``crossed``: its text decoder's length-dependent settings brought under the rows
    (``tests/length_crossing.py``, without the runtime rope switch: a layout mixes documents on both sides of its
    threshold), the same weights, the settings in ``model.crossed_settings``."""
    from tests.length_crossing import cross_config, rope_dims

    configs = {"llava": tiny_llava_config, "internvl": internvl_config, "llava_next": llava_next_config}
    configs["llava_onevision"] = llava_onevision_config
    configs |= {"mistral3": mistral3_config, "lfm2_vl": lfm2_vl_config, "gemma3": gemma3_config}
    configs |= {f: functools.partial(shuffled_config, f) for f in SHUFFLED} | {"lighton_ocr": lighton_ocr_config}
    configs |= {f: functools.partial(idefics_config, f) for f in IDEFICS} | {"got_ocr2": got_ocr2_config}
    configs |= {f: functools.partial(llava_like_config, f) for f in LLAVA_LIKE[1:]}
    configs |= {"llava_next_video": llava_next_video_config, "paddleocr_vl": paddleocr_vl_config}
    configs["qianfan_ocr"] = functools.partial(internvl_config, "qianfan_ocr")
    configs |= {f: functools.partial(gemma4_config, f) for f in GEMMA4} | {"llama4": llama4_config}
    configs |= EXTRA_CONFIGS | MROPE_CONFIGS
    config = configs[family]() if family in configs else qwen_vl_config(family)
    model = _instantiate_vlm(family, config, seed)
    model.crossed_settings = {}
    if crossed:
        text, settings = cross_config(config.get_text_config(), rope_dims(model), runtime_rope=False)
        if text is not None:
            config.text_config = text
            model = _instantiate_vlm(family, config, seed)
            model.crossed_settings = settings
    return model


def _instantiate_vlm(family: str, config, seed: int):
    import transformers

    from tests.family_harness import unit_scale_temperature
    from tests.harness import init_large_sinks, weak_decay

    torch.manual_seed(seed)
    attn = "eager" if family in ("got_ocr2", "hy_v4_vl") else "sdpa"  # they refuse sdpa (HY-V4-VL: its sinks)
    model = getattr(transformers, FAMILIES[family])._from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        if family in GEMMA4:  # its position table starts as ones: every patch alike, attention all ties
            model.model.vision_tower.patch_embedder.position_embedding_table.normal_()
    unit_scale_temperature(model)  # Gemma4's tower and decoder: scale-1 attention, q / k norms at 1 / sqrt(head_dim)
    weak_decay(model)  # hybrids: a state that reaches across the shards
    init_large_sinks(model, seed)  # HY-V4-VL: its decoder's attention sinks drawn large, as the text suite's
    return model.eval()


def make_examples(docs: list[Doc], family: str = "qwen2_vl", seed: int = 0) -> list[dict]:
    """Processor-like examples: ``input_ids``, ``mm_token_type_ids`` (text 0, image 1, video 2) and the media tensors
    of each document, laid out as the family's processor does (Qwen3-VL / GLM-4V: each video frame its own
    ``<t> <vision_start> ... <vision_end>`` run, GLM-4V's at the image token; LLaVA: a whole image per medium)."""
    from hf_sp_trainer.collators.multimodal import MODALITY_TYPE

    frames_apart = family.startswith("qwen3") or family in GLM or family in FRAMES_APART
    g = torch.Generator().manual_seed(seed)
    out = []
    for doc in docs:
        ids: list[int] = []
        types: list[int] = []
        pixels = {"image": [], "video": []}
        grids = {"image": [], "video": []}  # Gemma4: the patch positions
        example_frames: list[int] = []  # Gemma4: frames per video
        for i, n in enumerate(doc.text):
            ids += torch.randint(3, IMG, (n,), generator=g).tolist()
            types += [0] * (len(ids) - len(types))
            if i < len(doc.media):
                modality, (t, h, w) = doc.media[i]
                if family in VIDEO_FRAMES and modality == "video":  # t frames of 8 x 8 pixels (h, w unused)
                    count = t * placeholders_per_frame(family)
                    ids += [VSTART] + [VID] * count + [VEND]
                    types += [MODALITY_TYPE["video"] if x == VID else 0 for x in ids[len(types) :]]
                    pixels["video"].append(torch.randn(1, t, 3, LLAVA_IMAGE, LLAVA_IMAGE, generator=g))
                    continue
                if family in TILED:  # an image of 4h x 4w pixels: its tiles, as many placeholders as features
                    image, count = llava_next_image((4 * h, 4 * w), g, family, len(doc.media))
                    ids += [IMG] * count
                    types += [MODALITY_TYPE["image"]] * count
                    pixels["image"].append(image)
                    grids["image"].append(torch.tensor([[4 * h, 4 * w]]))
                    continue
                if family in GEMMA4:  # per image / video frame: h x w patches, (h/2)(w/2) placeholders
                    token = IMG if modality == "image" else VID
                    for _ in range(t):
                        stamp = [int(torch.randint(3, IMG, (1,), generator=g))] if modality == "video" else []
                        ids += stamp + [VSTART] + [token] * (h * w // 4) + [VEND]
                        frame = gemma4_patches(h, w, g)
                        pixels[modality].append(frame[0][None])
                        grids[modality].append(frame[1][None])
                    types += [MODALITY_TYPE[modality] if x == token else 0 for x in ids[len(types) :]]
                    if modality == "video":
                        example_frames.append(t)
                    continue
                if family in EXTRA_FAMILIES or family in OWN_LAYOUT:  # multimodal_families_extra / _mrope.py
                    medium_of = extra_medium if family in EXTRA_FAMILIES else mrope_medium
                    run, medium, grid = medium_of(family, modality, (t, h, w), g)
                    ids += run
                    token = IMG if modality == "image" or family in SPAN_VIDEOS else VID
                    types += [MODALITY_TYPE[modality] if x == token else 0 for x in ids[len(types) :]]
                    pixels[modality].append(medium)
                    grids[modality].append(grid)
                    continue
                if family == "llama4":  # its tiles (a layout's video: an image), TILE placeholders each
                    image_ids, image = llama4_image(h, w, g)
                    ids += image_ids
                    types += [MODALITY_TYPE["image"] if x == IMG else 0 for x in ids[len(types) :]]
                    pixels["image"].append(image)
                    continue
                if family == "lfm2_vl":  # h x w patches of 2 x 2 pixels (NaFlex rows), (h/2)(w/2) placeholders
                    ids += [VSTART] + [IMG] * (h * w // 4) + [VEND]
                    types += [MODALITY_TYPE["image"] if x == IMG else 0 for x in ids[len(types) :]]
                    pixels["image"].append(torch.randn(h * w, 3 * 2 * 2, generator=g))
                    grids["image"].append(torch.tensor([[h, w]]))
                    continue
                if family in PIXTRAL:  # 4h x 4w pixels: h rows of w placeholders, [IMG_BREAK] between rows
                    rows = [[IMG] * w + [IMG_BREAK] for _ in range(h)]
                    rows[-1][-1] = IMG_END
                    ids += [x for row in rows for x in row]
                    types += [MODALITY_TYPE["image"] if x == IMG else 0 for x in ids[len(types) :]]
                    pixels["image"].append(torch.randn(1, 3, 4 * h, 4 * w, generator=g))
                    grids["image"].append(torch.tensor([[4 * h, 4 * w]]))
                    continue
                if family in ONE_D:  # a whole image (LLaVA) or tile (InternVL, Gemma3: in <img> ... </img>)
                    sizes = {"gemma3": GEMMA3_IMAGE} | dict.fromkeys(LLAVA_LIKE, LLAVA_IMAGE)
                    size = sizes.get(family, 16 if family in SHUFFLED else INTERNVL_TILE)
                    run = [IMG] * placeholders_per_image(family)
                    ids += run if family == "llava" else [VSTART, *run, VEND]
                    types += [MODALITY_TYPE["image"] if x == IMG else 0 for x in ids[len(types) :]]
                    pixels["image"].append(torch.randn(1, 3, size, size, generator=g))
                    continue
                if family == "paddleocr_vl":  # images only: a layout's video becomes an image of one frame
                    modality, t = "image", 1
                glm = family in GLM  # GLM-4V: video frames at the image token
                token = IMG if modality == "image" or glm else VID
                runs = t if frames_apart and modality == "video" else 1
                for _ in range(runs):
                    stamp = [int(torch.randint(3, IMG, (1,), generator=g))] if runs > 1 else []
                    ids += stamp + [VSTART] + [token] * (t // runs * h * w // MERGE**2) + [VEND]
                types += [MODALITY_TYPE[modality] if x == token else 0 for x in ids[len(types) :]]
                if family == "paddleocr_vl":  # patches of [3, 2, 2] pixels
                    pixels[modality].append(torch.randn(t * h * w, 3, PATCH, PATCH, generator=g))
                else:
                    pixels[modality].append(torch.randn(t * h * w, PATCH_DIM, generator=g))
                grids[modality].append(torch.tensor([[t, h, w]]))
        example = {"input_ids": torch.tensor(ids), "mm_token_type_ids": torch.tensor(types)}
        example |= mrope_token_types(family, example["input_ids"])  # ERNIE-4.5-VL: its experts' token types
        if family == "gemma3":  # its processor's token_type_ids: 1 at the image tokens (they drive its image mask)
            example["token_type_ids"] = (torch.tensor(ids) == IMG).long()
        if family in TILED and pixels["image"]:  # [images, patches, 3, 8, 8], zero-padded as the processor
            most = max(x.shape[0] for x in pixels["image"])
            padded = [F.pad(x, (0, 0, 0, 0, 0, 0, 0, most - x.shape[0])) for x in pixels["image"]]
            example |= {"pixel_values": torch.stack(padded), "image_sizes": torch.cat(grids["image"])}
            if family == "llava_onevision":  # its processor's count: several images per example skip the tiles
                example["batch_num_images"] = torch.tensor([len(pixels["image"])])
        elif family in GEMMA4:  # [images / frames, patches, 12], their positions, frames per video
            if pixels["image"]:
                example |= {"pixel_values": torch.cat(pixels["image"]), "image_position_ids": torch.cat(grids["image"])}
            if pixels["video"]:
                example |= {
                    "pixel_values_videos": torch.cat(pixels["video"]),
                    "video_position_ids": torch.cat(grids["video"]),
                    "num_frames_per_video": torch.tensor(example_frames),
                }
        elif family == "lfm2_vl" and pixels["image"]:  # [images, most patches, 12], a mask of the real ones
            most = max(x.shape[0] for x in pixels["image"])
            mask = torch.stack([torch.arange(most) < x.shape[0] for x in pixels["image"]]).long()
            padded = torch.stack([F.pad(x, (0, 0, 0, most - x.shape[0])) for x in pixels["image"]])
            example |= {
                "pixel_values": padded,
                "spatial_shapes": torch.cat(grids["image"]),
                "pixel_attention_mask": mask,
            }
        elif family in PIXTRAL and pixels["image"]:  # [images, 3, H, W], zero-padded to the largest
            tall, wide = (max(x.shape[d] for x in pixels["image"]) for d in (2, 3))
            padded = [F.pad(x, (0, wide - x.shape[3], 0, tall - x.shape[2])) for x in pixels["image"]]
            example |= {"pixel_values": torch.cat(padded), "image_sizes": torch.cat(grids["image"])}
        elif family in ONE_D or family == "llama4":
            if pixels["image"]:  # Idefics3 / SmolVLM: [1, images, 3, h, w], the collator zero-pads the images dim
                example["pixel_values"] = (
                    torch.cat(pixels["image"])[None] if family in IDEFICS else torch.cat(pixels["image"])
                )
        elif pixels["image"]:
            example |= {"pixel_values": torch.cat(pixels["image"]), "image_grid_thw": torch.cat(grids["image"])}
        if pixels["video"] and family in VIDEO_FRAMES:
            example["pixel_values_videos"] = torch.cat(pixels["video"])
        elif pixels["video"] and family not in GEMMA4:
            example |= {"pixel_values_videos": torch.cat(pixels["video"]), "video_grid_thw": torch.cat(grids["video"])}
        out.append(example)
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def reference(model, examples: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Every document alone through the model's own forward (its own mrope positions and merge): summed token losses."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for ex in examples:
        ids = ex["input_ids"][None]
        per_token = ("token_type_ids", "moe_mm_token_type_ids")  # Gemma3: its image mask; ERNIE-4.5-VL: its experts
        media = {k: v for k, v in ex.items() if k not in ("input_ids", "mm_token_type_ids", *per_token)}
        base = vlm_base(model)
        if hasattr(base, "get_rope_index") or type(base).__name__ == "Gemma4Model":  # mrope / its mask
            media["mm_token_type_ids"] = ex["mm_token_type_ids"][None]
        media |= {k: ex[k][None] for k in per_token if k in ex}
        logits = forward_logits(model, input_ids=ids, **media)
        labels = F.pad(ids[:, 1:], (0, 1), value=-100)
        total = total + F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    total.backward()
    return total.item(), _grads(model)


def sp_run(model, sp, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The packed row under SP: each rank's token-loss sum, loss and gradients summed over the SP group."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    shard = sp.shard_batch(batch)
    shift = shard.pop("shift_labels")
    shard.pop("labels")
    logits = forward_logits(model, **shard)
    loss = F.cross_entropy(logits.flatten(0, 1), shift.flatten(), reduction="sum")
    loss.backward()
    group = sp.topology.sp_group
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = _grads(model)
    flat = torch.cat([g.flatten() for g in grads.values()])
    dist.all_reduce(flat, group=group)
    out_grads, i = {}, 0
    for name, g in grads.items():
        out_grads[name] = flat[i : i + g.numel()].view_as(g)
        i += g.numel()
    return total.item(), out_grads


# ----------------------------------------------------------------------------------------------------------------
# the kernel-level matrix: one spawned group runs every case
# ----------------------------------------------------------------------------------------------------------------
LAYOUTS = {
    # an image opens the row; a text-only document; an image straddling the sp-2 boundary, then a video
    "mixed": [
        Doc((0, 5), (("image", (1, 4, 4)),)),
        Doc((7,)),
        Doc((2, 3, 2), (("image", (1, 4, 6)), ("video", (2, 4, 4)))),
    ],
    # lengths that need SP's padding document; two images in one document, one a single token
    "padded": [Doc((4, 1, 3), (("image", (1, 2, 2)), ("image", (1, 4, 4)))), Doc((9, 3), (("video", (2, 2, 4)),))],
    # GLM-4V takes images or videos in one batch, not both: a row of each, an image / a video frame across the
    # sp-2 boundary, a 1-token document
    "images": [
        Doc((0, 5), (("image", (1, 4, 4)),)),
        Doc((1,)),
        Doc((0, 3, 2), (("image", (1, 4, 6)), ("image", (1, 2, 2)))),
    ],
    "videos": [Doc((1, 2), (("video", (2, 4, 8)),)), Doc((1,)), Doc((2, 1), (("video", (2, 2, 2)),))],
    # one long video (4 temporal rows) and a text document: split over the ranks by frame (split media, FRAME_BASES)
    "one_video": [Doc((2, 3), (("video", (4, 4, 4)),)), Doc((3,))],
    # enough media to split over 4 ranks (split media): five images of three sizes, two of them adjacent, two videos
    "many": [
        Doc((0, 3, 2), (("image", (1, 4, 4)), ("image", (1, 2, 2)))),
        Doc((4,)),
        Doc((1, 2, 0, 3), (("image", (1, 4, 6)), ("image", (1, 2, 4)), ("image", (1, 4, 4)))),
        Doc((2, 1, 1), (("video", (2, 4, 4)), ("video", (2, 2, 2)))),
    ],
}


@dataclass
class Case:
    family: str
    layout: str
    ring: int | None = None
    frozen: bool = False  # the vision tower frozen: encoded under no_grad, only the decoder trains
    split: bool = False  # split media: the media split over the SP ranks, their features exchanged
    crossed: bool = False  # the text decoder's length-dependent settings under the rows (tests/length_crossing.py)

    @property
    def name(self) -> str:
        ring = f"_ring{self.ring}" if self.ring else ""
        flags = "".join(f"_{f}" for f in ("frozen", "split", "crossed") if getattr(self, f))
        return f"{self.family}_{self.layout}{ring}{flags}"


def vision_tower(model) -> torch.nn.Module:
    """The VLM's vision encoder: ``visual`` (Qwen-VL), ``vision_tower``, or ``vision_model`` (Llama-4)."""
    base = vlm_base(model)
    return next(getattr(base, a) for a in ("visual", "vision_tower", "vision_model") if hasattr(base, a))


def run_case(case: Case, sp_size: int, float64: bool = False, inject: tuple[float, bool] | None = None) -> dict:
    """The case's SP run against each document alone: its worst relative error (``error``, ``where``) and what it
    ran; ``float64``: the model, its media and its pinned fp32 islands in float64 (``exactness.judge``'s float64 run;
    ``reference``: the one-process run's loss and gradients); ``inject``: a negative control's SP error."""
    from hf_sp_trainer import SPMultimodalCollator, apply_sequence_parallel

    model = build_vlm(case.family, crossed=case.crossed)
    if case.frozen:
        vision_tower(model).requires_grad_(False)
    examples = make_examples(LAYOUTS[case.layout], case.family)
    if float64:
        model = widened(model)
        examples = [{k: v.double() if v.is_floating_point() else v for k, v in e.items()} for e in examples]
    with float64_scope(model):
        ref = reference(model, examples)
    acts = worst_error(ref, reference(build_vlm(case.family), examples))[0] if model.crossed_settings else None
    batch = SPMultimodalCollator(model)(examples)
    with apply_sequence_parallel(model, sp_size, ring_size=case.ring, split_media=case.split) as sp:
        if inject is not None:
            inject_error(model, *inject)
        with float64_scope(model):
            got = sp_run(model, sp, batch)
        exchanged = sp.media.exchanged
    worst, where = worst_error(ref, got)
    length = batch["input_ids"].shape[1]
    return {
        "error": worst,
        "where": where,
        "length": length,
        "params": len(ref[1]),
        "exchanged": exchanged,
        "crossed": model.crossed_settings,
        "acts": acts,
        "reference": ref,
    }


def judged_case(case: Case, sp_size: int, inject: tuple[float, bool] | None = None) -> dict:
    """``run_case`` judged by ``exactness.judge`` on every rank alike (the fp32 gap agreed by an all-reduce first):
    past ``EXACT`` (or a ``NEAR_THE_BAR`` family), the case again wholly in float64; ``exact`` and ``verdict``."""
    import torch.distributed as dist

    result = run_case(case, sp_size, inject=inject)
    fp32 = torch.tensor([result["error"]], dtype=torch.float64)
    dist.all_reduce(fp32, op=dist.ReduceOp.MAX)

    def float64_run() -> tuple[float, float]:
        wide = run_case(case, sp_size, float64=True, inject=inject)
        return wide["error"], worst_error(wide["reference"], result["reference"])[0]

    near, control = case.family in NEAR_THE_BAR, inject is not None
    verdict = judge(case.name, float(fp32), float64_run, result["where"], near, control)
    del result["reference"]
    return result | {"exact": verdict.exact, "verdict": str(verdict), "float64": verdict.float64}


def run_matrix(cases: list[Case], sp_size: int, inject: tuple[float, bool] | None = None) -> dict[str, dict]:
    import torch.distributed as dist
    from transformers.utils import logging

    logging.set_verbosity_error()
    dist.init_process_group("gloo")
    return {case.name: judged_case(case, sp_size, inject) for case in cases}


def run_matrix_without(cases: list[Case], sp_size: int) -> dict[str, dict]:
    """``run_matrix`` again, negative controls: the images without their pairs ``p < j`` (causal), then without
    those in a later key chunk (the blocks a causal ring skips); Gemma4's with the pairs on its full-attention layers
    too (every layer, as Gemma3)."""
    import dataclasses

    import torch.distributed as dist

    import hf_sp_trainer.attention.ring as ring
    import hf_sp_trainer.attention.ulysses as ulysses
    import hf_sp_trainer.sharding.zigzag as zigzag

    original, mark = zigzag._image_tasks, ulysses.mark_image_block_layers
    out = {}
    try:
        zigzag._image_tasks = lambda *args: []
        ring._cached_plan.cache_clear()
        dist.init_process_group("gloo")
        out |= {f"{case.name}_causal": run_case(case, sp_size) for case in cases}
        zigzag._image_tasks = lambda *args: [t for t in original(*args) if t.kind != "full"]
        ring._cached_plan.cache_clear()
        for case in cases:
            if case.ring:
                out[f"{case.name}_next_chunk_skipped"] = run_case(case, sp_size)
        zigzag._image_tasks = original
        ring._cached_plan.cache_clear()
        ulysses.mark_image_block_layers = lambda decoder, rule: mark(
            decoder, dataclasses.replace(rule, sliding_only=False)
        )
        for case in cases:
            if case.family in GEMMA4:
                out[f"{case.name}_every_layer"] = run_case(case, sp_size)
    finally:
        zigzag._image_tasks, ulysses.mark_image_block_layers = original, mark
        ring._cached_plan.cache_clear()
    return {name: {k: v for k, v in result.items() if k != "reference"} for name, result in out.items()}


# ----------------------------------------------------------------------------------------------------------------
# Trainer level: SPTrainer against plain Trainer on one process, one padded row per document
# ----------------------------------------------------------------------------------------------------------------
def pad_rows(features: list[dict]) -> dict[str, torch.Tensor]:
    """The reference collator: one right-padded row per document, the model computes its own positions."""
    from hf_sp_trainer.collators.multimodal import MEDIA_KEYS, PER_TOKEN_KEYS, concat_media

    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = f["input_ids"]
        mask[i, : len(f["input_ids"])] = 1
    types = torch.zeros_like(ids)
    for i, f in enumerate(features):
        types[i, : len(f["input_ids"])] = f["mm_token_type_ids"]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    batch["mm_token_type_ids"] = types
    for key in PER_TOKEN_KEYS:  # ERNIE-4.5-VL's moe_mm_token_type_ids: right-padded as input_ids
        if features[0].get(key) is not None:
            batch[key] = torch.zeros_like(ids)
            for i, f in enumerate(features):
                batch[key][i, : len(f["input_ids"])] = torch.as_tensor(f[key])
    if "token_type_ids" in features[0]:  # Gemma3: its image mask
        batch["token_type_ids"] = (types == 1).long()
    for key in MEDIA_KEYS:
        values = [f[key] for f in features if f.get(key) is not None]
        if values:
            batch[key] = concat_media(values, key)  # padded where shapes differ, as the processors pad
    return batch


TRAIN_DOCS = [
    Doc((3, 4), (("image", (1, 4, 4)),)),
    Doc((6,)),
    Doc((2, 3, 2), (("image", (1, 4, 6)), ("video", (2, 4, 4)))),
    Doc((0, 8), (("image", (1, 2, 4)),)),
    Doc((5, 5), (("video", (2, 2, 2)),)),
    Doc((11,)),
    Doc((1, 2), (("image", (1, 4, 4)),)),
    Doc((4, 3), (("image", (1, 2, 2)),)),
]


def train_vlm(
    family: str,
    sp_size: int,
    ring: int | None,
    out_dir: str,
    steps: int = 3,
    ga: int = 2,
    lora: bool = False,
    split: bool = False,
    router_loss: bool = False,
) -> dict:
    """Train ``steps`` SGD steps (4 documents per micro-batch and data-parallel rank, ``ga`` micro-batches a step):
    plain ``Trainer`` with ``pad_rows`` (``sp_size=1``: one process, or DDP where spawned), else ``SPTrainer`` with its
    default (multimodal packing) collator. ``lora``: LoRA on the decoder's q/v projections, the tower frozen;
    ``split``: ``sp_split_media`` (split media); ``router_loss``: an MoE decoder's load-balancing loss in the loss."""
    import torch.distributed as dist
    import transformers

    from hf_sp_trainer import SPMultimodalCollator, SPTrainer, TrainingArguments
    from tests.harness import full_parameters, logged_steps, quiet_args

    model = build_vlm(family)
    if router_loss:  # an MoE decoder's load-balancing loss added to the loss (transformers' own formula)
        model.config.text_config.output_router_logits = True
        model.config.text_config.router_aux_loss_coef = 0.5
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = r"model\.language_model\..*\.(q_proj|v_proj)"  # the decoder's only: the tower stays frozen
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    docs = TRAIN_DOCS
    examples = make_examples(docs, family)
    common = dict(
        quiet_args(out_dir, steps),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=ga,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        remove_unused_columns=False,
        dataloader_drop_last=False,
    )
    tuple_path = not model.config.return_dict  # Llama-4: its forward's tuple path (tests/multimodal_llama4.py)
    if sp_size == 1:
        args = transformers.TrainingArguments(**common)
        collator = with_return_dict(pad_rows) if tuple_path else pad_rows
        trainer = transformers.Trainer(model=model, args=args, train_dataset=examples, data_collator=collator)
    else:
        args = TrainingArguments(**common, sp_size=sp_size, sp_ring_size=ring, sp_split_media=split)
        collator = with_return_dict(SPMultimodalCollator(model)) if tuple_path else None  # None: SPTrainer's own
        trainer = SPTrainer(model=model, args=args, train_dataset=examples, data_collator=collator)
    aux = []  # the router loss each forward returned (None: not computed)
    model.register_forward_hook(lambda m, a, output: aux.append(getattr(output, "aux_loss", None)))
    trainer.train()
    logs = logged_steps(trainer)
    params = full_parameters(model)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    exchanged = trainer.sp.media.exchanged if sp_size > 1 else 0  # the last forward's media kinds split (split media)
    out = {"losses": [x for x, _ in logs], "grad_norms": [g for _, g in logs], "exchanged": exchanged}
    return out | {"params": params if rank0 else None, "router_loss": all(a is not None for a in aux)}


# ----------------------------------------------------------------------------------------------------------------
# the VLM table of docs/models.md
# ----------------------------------------------------------------------------------------------------------------
@functools.cache  # test_multimodal's check and test_model_families' docs/models.md: built once a session
def classify_vlms(sp_size: int = 2) -> list[tuple[str, str, str, str]]:
    """``(model type, class, status, reason)`` for every image-text-to-text model type of the installed transformers:
    its default config built on the meta device and put through ``validate_model_for_sp`` (no collective, no
    weights). *exact*: accepted, which only the families proven in this file's matrix are; *refused*: the error."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    from transformers.utils import logging

    from hf_sp_trainer.multimodal import is_multimodal
    from hf_sp_trainer.validate import validate_model_for_sp

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    rows = []
    try:
        for model_type, class_name in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()):
            try:
                with torch.device("meta"):
                    model = getattr(transformers, class_name)(CONFIG_MAPPING[model_type]())
            except Exception as exc:  # noqa: BLE001 - listed, not hidden
                if class_name in FAMILIES.values():  # proven on this file's tiny config (Aya Vision's default breaks)
                    why = f"tests/test_multimodal.py (its default config can't build: {_first_line(exc)})"
                    rows.append((model_type, class_name, "exact", why))
                else:
                    rows.append((model_type, class_name, "can't build", _first_line(exc)))
                continue
            if not is_multimodal(model):
                continue  # a text-only causal LM (Mistral4): in the causal-LM table
            try:
                validate_model_for_sp(model, sp_size)
                rows.append((model_type, class_name, "exact", "tests/test_multimodal.py"))
            except ValueError as exc:
                rows.append((model_type, class_name, "refused", _first_line(exc)))
    finally:
        logging.set_verbosity(verbosity)
    return rows


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, KeyError):  # a default config missing a key the modeling code looks up (in set order)
        return "KeyError: the default config lacks a key its modeling code looks up"
    if "library but it was not found" in str(exc):  # which one depends on what this environment has installed
        return "needs an optional library that is not installed (timm, PIL, ...)"
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300].replace("|", "\\|")


# ----------------------------------------------------------------------------------------------------------------
# TRL's vision SFT format (hf_sp_trainer.data.tiny_vlm: a LLaVA processor built offline, messages + images)
# ----------------------------------------------------------------------------------------------------------------
def sft_vlm(sp_size: int, out_dir: str, steps: int = 3, assistant_only: bool = False) -> dict:
    """Three SGD steps of TRL SFT on the vision rows: ``trl.SFTTrainer`` (``sp_size=1``) or ``SPSFTTrainer``."""
    import torch.distributed as dist
    import trl
    from datasets import Dataset

    from hf_sp_trainer import SFTConfig, SPSFTTrainer
    from tests.harness import full_parameters, logged_steps, quiet_args

    model = build_vlm("llava")
    common = dict(
        quiet_args(out_dir, steps),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_length=None,
        assistant_only_loss=assistant_only,
        bf16=False,  # TRL defaults to bf16; the equivalence is checked in fp32
    )
    dataset = Dataset.from_list(vision_conversations())
    if sp_size == 1:
        trainer_cls, args = trl.SFTTrainer, trl.SFTConfig(**common)
    else:
        trainer_cls, args = SPSFTTrainer, SFTConfig(**common, sp_size=sp_size)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tiny_llava_processor())
    trainer.train()
    logs = logged_steps(trainer)
    params = full_parameters(model)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    return {"losses": [x for x, _ in logs], "grad_norms": [g for _, g in logs], "params": params if rank0 else None}


def vision_preferences(n: int = 8, seed: int = 1) -> list[dict]:
    """TRL's conversational vision preference format: ``images``, a user ``prompt`` (0-2 images, one placeholder
    each, and text), and a ``chosen`` / ``rejected`` assistant answer of different lengths."""
    rows = []
    for i, row in enumerate(vision_conversations(n, seed)):
        user, answer = row["messages"]
        text = answer["content"][0]["text"]
        rejected = {"role": "assistant", "content": [{"type": "text", "text": text[::-1] + "zu" * (i % 3)}]}
        rows.append({"images": row["images"], "prompt": [user], "chosen": [answer], "rejected": [rejected]})
    return rows


def tiny_qwen_vl_processor():
    """A Qwen2-VL processor built offline: the character tokenizer with Qwen's vision tokens, Qwen's PIL image
    processor (2 x 2 patches, merged 2 x 2: an 8 x 8 image is 4 placeholders) and the vision chat template. Its
    images-only subclass skips the video processor (torchvision, which the CPU test install lacks)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    from hf_sp_trainer.data.tokenizer import build_char_tokenizer

    class ImagesOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id, self.video_token_id = IMG, VID
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    names = {"<|image_pad|>": IMG, "<|video_pad|>": VID, "<|vision_start|>": VSTART, "<|vision_end|>": VEND}
    tokenizer = build_char_tokenizer(names)
    tokenizer.chat_template = None  # the processor's template
    images = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE,
                                      min_pixels=16, max_pixels=1024)  # fmt: skip
    template = tiny_vlm.VISION_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    return ImagesOnlyQwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)


def dpo_vlm(sp_size: int, out_dir: str, steps: int = 3, family: str = "llava", kind: str = "dpo") -> dict:
    """Three SGD steps of TRL DPO (``kind="kto"``: KTO, each pair split into a desirable and an undesirable example)
    on vision preference rows (a reference model given): ``trl.DPOTrainer`` / ``trl.KTOTrainer`` (``sp_size=1``) or
    ``SPDPOTrainer`` / ``SPKTOTrainer``; the logged metrics, eval metrics and the policy's weights. ``family``: LLaVA
    with its processor, or a multimodal-rope VLM (Qwen2-VL, Qwen3-VL, GLM-4V) with the tiny Qwen2-VL processor,
    whose output (patch rows, grids, ``mm_token_type_ids``, vision start / end tokens) the others' tiny configs
    take as well (their own processors need torchvision)."""
    import torch.distributed as dist
    import trl
    from datasets import Dataset

    import hf_sp_trainer
    from tests.harness import full_parameters, quiet_args

    model, ref = build_vlm(family), build_vlm(family, seed=1)  # a reference other than the policy
    common = dict(
        quiet_args(out_dir, steps),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_length=None,
        bf16=False,  # TRL defaults to bf16; the equivalence is checked in fp32
        dataset_num_proc=None,
    )
    config, trainer = {"dpo": ("DPOConfig", "DPOTrainer"), "kto": ("KTOConfig", "KTOTrainer")}[kind]
    if sp_size == 1:
        trainer_cls, args = getattr(trl, trainer), getattr(trl, config)(**common)
    else:
        sp_args = dict(common, sp_size=sp_size, ddp_backend="gloo")
        trainer_cls, args = getattr(hf_sp_trainer, f"SP{trainer}"), getattr(hf_sp_trainer, config)(**sp_args)
    rows = vision_preferences(4 * steps + 4)
    if kind == "kto":  # the chosen answer desirable, the rejected one undesirable: mixed within each batch
        split = [(r["chosen"], True) if i % 2 else (r["rejected"], False) for i, r in enumerate(rows)]
        rows = [
            {"images": r["images"], "prompt": r["prompt"], "completion": c, "label": label}
            for r, (c, label) in zip(rows, split, strict=True)
        ]
    trainer = trainer_cls(
        model=model,
        ref_model=ref,
        args=args,
        train_dataset=Dataset.from_list(rows[: 4 * steps]),
        eval_dataset=Dataset.from_list(rows[4 * steps :]),
        processing_class=tiny_llava_processor() if family == "llava" else tiny_qwen_vl_processor(),
    )
    trainer.train()
    evals = {
        k: v for k, v in trainer.evaluate().items() if k not in ("eval_runtime", "epoch") and "per_second" not in k
    }
    skip = ("epoch", "step", "tokens_per_second_per_rank", "step_time_s", "peak_memory_mb", "mfu")
    logs = [{k: v for k, v in e.items() if k not in skip} for e in trainer.state.log_history if "grad_norm" in e]
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    params = full_parameters(model) if rank0 else None
    return {"logs": logs, "eval": evals, "reward_predictions": None, "params": params}
