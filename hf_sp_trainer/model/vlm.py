"""The parts of a vision-language model that sequence parallelism touches, and the VLMs it refuses.

SP runs in the *text decoder* only (the language model inside the VLM base model); the vision / audio encoders keep
their own kernel and encode every medium of the batch on every rank (``multimodal.features``). A VLM is supported
when transformers lets the encoder outputs be passed in precomputed (``mm_encoder_outputs``), so the model's own
merge runs on the rank's shard, and when nothing in its decoder depends on more than the shard SP gives it; the
checks read the model's modules, config and forward signature, not a list of family names.
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from ..sharding.image_blocks import ImageBlockRule

PIXELS = {"image": "pixel_values", "video": "pixel_values_videos"}  # each modality's pixel input of the base model
PADDING_POSITION = -1  # Gemma4's image / video_position_ids at padding patches


def feature_rows(level) -> torch.Tensor:
    """An encoder output's features as one tensor: a tuple / list per medium (Qwen-VL, LLaVA) concatenated."""
    return torch.cat(list(level)) if isinstance(level, (list, tuple)) else level


def temporal_merge(config, modality: str) -> int:
    """Frames merged into each feature row of a video beyond its grid (ERNIE-4.5-VL's resampler: the vision config's
    ``temporal_merge_size``, ``t * h * w / merge**2 / 2`` rows); 1 for images and for every other family."""
    return getattr(getattr(config, "vision_config", None), "temporal_merge_size", 1) if modality == "video" else 1


def feature_field(encoded) -> str:
    """The field of an encoder output (``get_image_features`` / ``get_video_features``) that the model merges at its
    placeholders: ``pooler_output``, or ``last_hidden_state`` where the encoder leaves ``pooler_output`` empty and the
    model's forward projects the last hidden state itself, row by row (Llama-4: its projector runs after the merge
    reads ``mm_encoder_outputs["image"].last_hidden_state``)."""
    return "pooler_output" if getattr(encoded, "pooler_output", None) is not None else "last_hidden_state"


MEDIA = ("image", "video")  # modalities whose features are merged at placeholder tokens
ENCODER_CONFIG_HINTS = ("vision", "audio", "image", "video", "speech", "vq")
# The VLM base models whose SP runs are proven exact by tests/test_multimodal.py (each has cases there; a test keeps
# the two in step). Any other VLM is refused: the generic path may well hold for it, but unproven it could be
# silently wrong (a merge that is not one feature row per placeholder, positions computed in the forward, ...).
# Image tokens that see their whole image (``sharding/image_blocks.py``), Ulysses and ring: Gemma3 on every layer;
# Gemma4 on its sliding layers, where its text config asks for it (``use_bidirectional_attention="vision"``).
IMAGE_BLOCK_MODELS = {
    "Gemma3Model": ImageBlockRule("token_type_ids", (1,)),
    "Gemma4Model": ImageBlockRule("mm_token_type_ids", (1, 2), sliding_only=True),
}
IMAGE_BLOCKS_WHEN = {"Gemma4Model": ("use_bidirectional_attention", "vision")}  # else causal throughout
VERIFIED = frozenset(
    {
        *("Qwen2VLModel", "Qwen2_5_VLModel", "Qwen3VLModel", "Qwen3VLMoeModel", "Qwen3_5Model", "Qwen3_5MoeModel"),
        *("Glm4vModel", "Glm4vMoeModel", "Glm46VModel", "GlmOcrModel"),  # video frames at the image token
        "PaddleOCRVLModel",  # Qwen2-VL's positions, images only
        *("LlavaModel", "LlavaNextModel", "Mistral3Model", "InternVLModel", "Lfm2VlModel"),  # 1-D positions
        *("AyaVisionModel", "Cohere2VisionModel", "LightOnOcrModel", "Idefics3Model", "SmolVLMModel"),
        *("Idefics2Model", "GotOcr2Model", "LlavaOnevisionModel"),
        *("VipLlavaModel", "VideoLlavaModel", "LlavaNextVideoModel", "QianfanOCRModel"),
        # Llama-4: the VLM is its own base (vision_model, multi_modal_projector, language_model); tiles, features
        # in last_hidden_state; its decoder's chunked attention and NoPE temperature: attention/position_rules.py.
        # (before transformers 5.25 its forward fails on a dict output, on one device too: tests/multimodal_llama4.py)
        "Llama4ForConditionalGeneration",
        "Kimi_K25Model",  # 1-D positions, a DeepSeek-V3 decoder (MLA, MoE); videos pooled per chunk of frames
        "Dots3NoteModel",  # 1-D positions; DSA + sliding-window MLA; no audio
        "MistralLarge4Model",  # Pixtral's images; DSA with position-scaled queries, NoPE and shared layers
        "MiniMaxM3VLModel",  # 1-D positions, images / videos through one tower; block-sparse selection
        "Glm5NextModel",  # NoPE; pooled DSA from each document's start + KDA; videos: frames inside spans
        "HYV4VLModel",  # mrope; a newline feature ends each merged row; HY-V4's DSA, sinks, hyper-connections
        "Ernie4_5_VLMoeModel",  # mrope; videos' frames merged in pairs; experts by moe_mm_token_type_ids (per token)
        "Qwen4ExpModel",  # Qwen3.5's mrope and tower; Gated DeltaNet, query-sparse attention, PLE n-grams
        *IMAGE_BLOCK_MODELS,  # Gemma3; Gemma4 (per-layer head sizes, per-layer embeddings, shared kv; no audio)
    }
)


def is_multimodal(model: torch.nn.Module) -> bool:
    """A model with encoders beside its text decoder: a VLM base model holding ``language_model``, or a config with
    an encoder sub-config (``vision_config``, ``audio_config``, ...)."""
    return vlm_base(model) is not None or bool(encoder_config_keys(model))


DECODER_ATTRS = ("language_model", "text_model")  # the text decoder inside a VLM base (Idefics3 / SmolVLM: text_model)


def vlm_base(model: torch.nn.Module) -> torch.nn.Module | None:
    """The VLM base model (``model.model`` of a ``...ForConditionalGeneration``), which merges media features into
    the token embeddings and calls its text decoder (``DECODER_ATTRS``); ``None`` for a text-only model."""
    for candidate in (model, getattr(model, "model", None)):
        if candidate is None or not hasattr(candidate, "get_image_features"):
            continue
        if any(isinstance(getattr(candidate, a, None), torch.nn.Module) for a in DECODER_ATTRS):
            return candidate
    return None


def text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder SP attaches to: the VLM's ``language_model`` (or ``text_model``), or the model itself."""
    base = vlm_base(model)
    if base is None:
        return model
    return next(getattr(base, a) for a in DECODER_ATTRS if isinstance(getattr(base, a, None), torch.nn.Module))


def encoder_config_keys(model: torch.nn.Module) -> list[str]:
    """The sub-configs of encoders (``vision_config``, ``audio_config``, ...): their attention keeps its kernel."""
    config = getattr(model, "config", None)
    subs = getattr(type(config), "sub_configs", {}) or {}
    keys = (k for k in subs if k != "text_config" and any(h in k for h in ENCODER_CONFIG_HINTS))
    return sorted(k for k in keys if getattr(config, k, None) is not None)


def token_ids(model: PreTrainedModel) -> dict[str, int]:
    """Placeholder token id per modality (``image_token_id`` / ``image_token_index``, ...), as the model's own merge
    uses them: GLM-4V places video frames at the image token (its placeholder mask is probed on two tokens)."""
    config, out = model.config, {}
    for modality in MEDIA:
        for name in (f"{modality}_token_id", f"{modality}_token_index"):
            value = getattr(config, name, None)
            if isinstance(value, int):
                out[modality] = value
                break
    if "image" in out and "video" in out and _video_at_image_token(model, out["image"], out["video"]):
        out["video"] = out["image"]
    return out


def shared_placeholder(ids: dict[str, int]) -> bool:
    """Images and videos share one placeholder token: one batch can't hold both (the model can't tell them apart)."""
    return len(set(ids.values())) < len(ids)


def _video_at_image_token(model: PreTrainedModel, image: int, video: int) -> bool:
    mask_fn = getattr(vlm_base(model), "get_placeholder_mask", None)
    if mask_fn is None:
        return False
    try:
        with torch.no_grad():
            masks = mask_fn(torch.tensor([[image, video]]), inputs_embeds=torch.zeros(1, 2, 1))
    except Exception:  # noqa: BLE001 - a mask function of another shape: the config's ids stand
        return False
    if not (isinstance(masks, tuple) and len(masks) == 2):
        return False
    at = masks[1].reshape(2, -1)[:, 0]
    return bool(at[0]) and not bool(at[1])


def row_newline(base: torch.nn.Module) -> int:
    """1 where the vision tower's patch merger ends every merged row with a learned newline feature (a module with
    ``spatial_merge_size`` and an ``image_newline`` parameter: HY-V4-VL, ``h / merge`` rows of ``w / merge + 1``
    placeholders per frame), else 0."""
    mergers = (m for m in base.modules() if hasattr(m, "spatial_merge_size"))
    return int(any(isinstance(getattr(m, "image_newline", None), torch.nn.Parameter) for m in mergers))


def span_marked_video(model: PreTrainedModel) -> tuple[int, int] | None:
    """``(start, end)``: the token ids around a video whose placeholders are image tokens that the model's own mask
    tells apart from an image's only by those spans (GLM-5-Next, probed on its ``get_placeholder_mask``); a rank's
    shard need not hold them. ``None`` for every other model."""
    config, base = model.config, vlm_base(model)
    start, end = (getattr(config, f"video_{k}_token_id", None) for k in ("start", "end"))
    image, mask_fn = token_ids(model).get("image"), getattr(base, "get_placeholder_mask", None)
    if not all(isinstance(t, int) for t in (start, end, image)) or mask_fn is None:
        return None
    try:
        with torch.no_grad():
            masks = mask_fn(torch.tensor([[start, image, end, image]]), inputs_embeds=torch.zeros(1, 4, 1))
    except Exception:  # noqa: BLE001 - a mask function of another shape: no spans
        return None
    if not (isinstance(masks, tuple) and len(masks) == 2):
        return None
    image_mask, video_mask = (m.reshape(4, -1)[:, 0] for m in masks)
    return (start, end) if bool(video_mask[1]) and not bool(video_mask[3]) and bool(image_mask[3]) else None


def uses_mrope(model: PreTrainedModel) -> bool:
    """Multimodal rotary positions (Qwen-VL, GLM-4V): ``[4, b, s]`` position ids (a text row, then t / h / w)."""
    base = vlm_base(model)
    return base is not None and hasattr(base, "get_rope_index")


ROPE_INPUTS = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def rope_index(
    base: torch.nn.Module, input_ids: torch.Tensor, inputs: dict, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The model's own multimodal rotary positions ``[3, rows, seq]`` (its ``get_rope_index``, called as its forward
    calls it) for ``input_ids`` with the media grids / token types in ``inputs``; with ``attention_mask``, each
    right-padded row counted on its own real tokens."""
    fn = base.get_rope_index
    params = inspect.signature(fn).parameters
    kwargs = {k: inputs[k] for k in ROPE_INPUTS if k in params and inputs.get(k) is not None}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with torch.no_grad():
        positions, _ = fn(input_ids, **kwargs)
    return positions.to(torch.long)


def check_multimodal(model: PreTrainedModel, sp_size: int) -> None:
    """Refuse (``ValueError``, no collective) a VLM SP can't run exactly; a no-op for text-only models."""
    if not is_multimodal(model):
        return
    name = type(model).__name__
    fix = f"Use sp_size=1 for this model (sp_size={sp_size})."
    base = vlm_base(model)
    if base is None:
        raise ValueError(
            f"{name} has encoders ({', '.join(encoder_config_keys(model))}) but no base model with a text decoder "
            f"and get_image_features, so SP can't run in its text decoder alone. {fix}"
        )
    forward = inspect.signature(type(base).forward).parameters
    if "mm_encoder_outputs" not in forward:
        raise ValueError(
            f"{name}: its base model {type(base).__name__} takes no precomputed encoder outputs (mm_encoder_outputs), "
            f"so SP can't merge media features into each rank's shard. {fix}"
        )
    if not token_ids(model):
        raise ValueError(f"{name} has no image/video placeholder token id in its config to place features at. {fix}")
    if _bidirectional_media(base) and type(base).__name__ not in IMAGE_BLOCK_MODELS:
        raise ValueError(
            f"{name} lets image tokens attend bidirectionally within their image (a mask built from token_type_ids); "
            f"SP attention is causal per document and would be silently wrong. {fix}"
        )
    text = model.config.get_text_config()
    bidirectional = getattr(text, "use_bidirectional_attention", False)
    if bidirectional and not (bidirectional == "vision" and image_block_rule(model) is not None):
        raise ValueError(
            f"{name}'s text decoder attends bidirectionally (use_bidirectional_attention={bidirectional!r}). {fix}"
        )
    if type(base).__name__ not in VERIFIED:
        raise ValueError(
            f"{name}: SP for its base model {type(base).__name__} is not verified exact yet (verified: "
            f"{', '.join(sorted(VERIFIED))}); refused rather than risk a silent difference. {fix}"
        )


def image_block_rule(model: torch.nn.Module) -> ImageBlockRule | None:
    """How image tokens attend bidirectionally within their image (Gemma3, Gemma4 in its "vision" mode): extra pairs
    of SP's block plan; ``None`` for a causal decoder."""
    base = vlm_base(model)
    name = type(base).__name__
    if base is None or name not in IMAGE_BLOCK_MODELS:
        return None
    field, value = IMAGE_BLOCKS_WHEN.get(name, (None, None))
    if field is not None and getattr(model.config.get_text_config(), field, None) != value:
        return None
    return IMAGE_BLOCK_MODELS[name]


def uses_image_blocks(model: torch.nn.Module) -> bool:
    return image_block_rule(model) is not None


def _bidirectional_media(base: torch.nn.Module) -> bool:
    """The base model builds a mask in which media tokens see later tokens of the same item (Gemma3-style).

    Read from the class's code (its forward builds the mask from ``token_type_ids``), not checked by behaviour: a
    behaviour check would run the base model's forward with media inputs only its processor can make, at setup,
    before the weights are placed (ZeRO-3 / FSDP2). It only decides to refuse an unverified VLM (the verified ones
    are ``IMAGE_BLOCK_MODELS``, checked exact by tests/test_multimodal.py)."""
    try:
        source = inspect.getsource(type(base))
    except (OSError, TypeError):
        return False
    return "token_type_ids" in source and ("bidirectional" in source or "block_sequence_ids" in source)
