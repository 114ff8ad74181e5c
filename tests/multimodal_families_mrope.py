"""ERNIE-4.5-VL and Qwen4-Exp's VLM in the multimodal matrix: multimodal-rope families beside Qwen-VL / GLM-4V, their
tiny configs and their processors' media layouts. Positions come from each model's own ``get_rope_index``, per
document, in the collator (``[4, b, s]``: a text row, then t / h / w).

- ERNIE-4.5-VL (``Ernie4_5_VLMoeForConditionalGeneration``): a NaViT-like tower on ``[patches, 3 * 2 * 2]`` rows, a
  resampler merging 2 x 2 patches and, for videos, pairs of frames (``temporal_merge_size``): an image of ``h x w``
  patches is ``h * w / 4`` placeholders, a video of ``t`` frames ``t * h * w / 8``, each in
  ``<start> <placeholder>*n <end>`` (its video processor draws timestamps on the frames, not in the text). Its
  decoder's MoE layers route text tokens to text experts and vision tokens to vision experts by
  ``moe_mm_token_type_ids`` (the processor's: placeholders and their start / end tokens), a per-token input the
  collator packs like ``input_ids``; a dense first layer, plain attention (Ulysses and ring).
- Qwen4-Exp (``Qwen4ExpForConditionalGeneration``): Qwen3.5-MoE's tower and processor (each video frame its own
  timestamped run, as Qwen3-VL), a ``qwen4_exp_text`` decoder (``tests/family_harness.py``'s tiny config): Gated
  DeltaNet layers, query-sparse attention (top-2 blocks of 4 tokens, under the documents' lengths; Ulysses and
  ring), hyper-connections, PLE layers with hashed n-grams of each document's earlier ids.
"""

from __future__ import annotations

import torch

from hf_sp_trainer.data import tiny_vlm

IMG, VID, VSTART, VEND, VSTART2, VEND2 = tiny_vlm.IMAGE_TOKEN_ID, 121, 122, 123, 124, 125  # the harness's ids
QSA_BUDGET = 8  # Qwen4-Exp: tokens per query, the top-2 blocks of 4 (the text family's compress ratio)

FAMILIES = {
    "ernie4_5_vl_moe": "Ernie4_5_VLMoeForConditionalGeneration",  # modality-isolated MoE, frames merged in pairs
    "qwen4_exp": "Qwen4ExpForConditionalGeneration",  # Gated DeltaNet + query-sparse attention, PLE, MoE
}
FRAMES_APART = ("qwen4_exp",)  # Qwen3-VL's processor: each video frame its own run (the harness's generic layout)
OWN_LAYOUT = ("ernie4_5_vl_moe",)  # laid out by ``mrope_medium``


def ernie4_5_vl_moe_config():
    """ERNIE-4.5-VL: a dense first layer, then modality-isolated MoE (4 text / 4 vision experts, top-2, a shared
    expert); mrope sections 3 / 3 / 2 of 8 rotary pairs; its tower and resampler at the harness's patch sizes."""
    from transformers import Ernie4_5_VLMoeConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
    text = dict(tiny_vlm.TINY_TEXT, head_dim=16, rope_parameters=rope, moe_num_experts=4, moe_k=2,
                moe_intermediate_size=[32, 16], moe_num_shared_experts=1)  # fmt: skip
    text["mlp_layer_types"] = ["dense", "sparse"]
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=2, spatial_merge_size=2,
                  temporal_merge_size=2, in_channels=3)  # fmt: skip
    return Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                                image_start_token_id=VSTART, image_end_token_id=VEND, video_start_token_id=VSTART2,
                                video_end_token_id=VEND2)  # fmt: skip


def qwen4_exp_config(budget: int = QSA_BUDGET):
    """Qwen4-Exp: the text family's tiny decoder (3 Gated DeltaNet layers, a QSA layer, PLE on two layers, MoE) with
    Qwen3.5's interleaved mrope; Qwen3.5-MoE's tiny tower (``qwen_vl_config``)."""
    from transformers import Qwen4ExpConfig

    from tests.family_harness import tiny_config
    from tests.multimodal_harness import qwen_vl_config

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    rope["partial_rotary_factor"] = 1.0
    text = tiny_config("qwen4_exp_text").to_dict() | {"rope_parameters": rope, "indexer_budget": budget}
    text["pad_token_id"] = 0
    vision = qwen_vl_config("qwen3_5_moe").vision_config.to_dict()
    return Qwen4ExpConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                          vision_start_token_id=VSTART, vision_end_token_id=VEND)  # fmt: skip


CONFIGS = {"ernie4_5_vl_moe": ernie4_5_vl_moe_config, "qwen4_exp": qwen4_exp_config}


def mrope_medium(
    family: str, modality: str, thw: tuple[int, int, int], g: torch.Generator
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """One image / video of a layout (``(t, h, w)`` patches) as ERNIE-4.5-VL's processor gives it: its tokens, its
    ``[t * h * w, 12]`` patch rows and its grid row; a video's ``t`` frames merged in pairs."""
    assert family in OWN_LAYOUT, family
    t, h, w = thw
    token, start, end, merged = (IMG, VSTART, VEND, 1) if modality == "image" else (VID, VSTART2, VEND2, 2)
    ids = [start] + [token] * (t * h * w // 4 // merged) + [end]
    return ids, torch.randn(t * h * w, 3 * 2 * 2, generator=g), torch.tensor([[t, h, w]])


def mrope_token_types(family: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """ERNIE-4.5-VL's ``moe_mm_token_type_ids`` as its processor makes them: image placeholders and image start / end
    tokens 1, video ones 2 (its vision experts take them), text 0; nothing for the other families."""
    if family != "ernie4_5_vl_moe":
        return {}
    types = torch.zeros_like(ids)
    types[torch.isin(ids, torch.tensor([IMG, VSTART, VEND]))] = 1
    types[torch.isin(ids, torch.tensor([VID, VSTART2, VEND2]))] = 2
    return {"moe_mm_token_type_ids": types}


def qsa_reference_gap(layout: str) -> float:
    """Negative control: how far the reference (each document alone) moves when Qwen4-Exp's QSA budget is taken out of
    reach of the rows (256 tokens: every block of every document selected)."""
    from tests.multimodal_harness import LAYOUTS, _instantiate_vlm, make_examples, reference, worst_error

    examples = make_examples(LAYOUTS[layout], "qwen4_exp")
    ref, every = (reference(_instantiate_vlm("qwen4_exp", qwen4_exp_config(b), 0), examples) for b in (QSA_BUDGET, 256))
    return worst_error(ref, every)[0]


def vision_experts_gap(layout: str) -> float:
    """Negative control: how far ERNIE-4.5-VL's reference moves when its ``moe_mm_token_type_ids`` are left out
    (every token to the text experts), so an SP run matching it at 1e-5 routes each token as the model does."""
    from tests.multimodal_harness import LAYOUTS, build_vlm, make_examples, reference, worst_error

    model = build_vlm("ernie4_5_vl_moe")
    examples = make_examples(LAYOUTS[layout], "ernie4_5_vl_moe")
    without = [{k: v for k, v in ex.items() if k != "moe_mm_token_type_ids"} for ex in examples]
    return worst_error(reference(model, examples), reference(model, without))[0]
