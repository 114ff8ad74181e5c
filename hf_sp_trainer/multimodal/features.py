"""Merge after slicing: each SP rank encodes the batch's media and keeps the feature rows of its own placeholders.

A forward pre-hook on the VLM base model runs before its merge. It encodes every image / video of the batch (the
same inputs on every rank of the SP group, so the same features; under ``no_grad`` when the encoder is frozen),
finds the global index of each of this rank's placeholder tokens (one small all-gather of the placeholder masks),
selects those rows (a differentiable ``index_select``; Qwen3-VL's deepstack levels likewise) and hands them to the
model as ``mm_encoder_outputs``. The model's own ``get_placeholder_mask`` / ``masked_scatter`` then run unchanged on
the shard: no rank builds the whole sequence's embeddings, and each encoder gradient arrives through the rank's own
rows (summed over the SP group by the data-parallel reduction, as for ``embed_tokens``). With ``split_media`` (phase
2, ``media_split.py``) each rank encodes only a group of the media and the feature rows are exchanged. GLM-5-Next's
video frames are image tokens inside video start / end spans a shard need not hold: its placeholders are told apart
on the whole sequence and the hook merges the rank's rows itself (``merge_own_rows``), as the model's merge does.
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from ..comm.all_to_all import all_gather_along
from ..model.vlm import (
    IMAGE_BLOCK_MODELS,
    PIXELS,
    feature_field,
    feature_rows,
    image_block_rule,
    shared_placeholder,
    span_marked_video,
    text_decoder,
    token_ids,
    uses_mrope,
    vlm_base,
)
from ..sharding import SequenceSharding
from ..sharding.image_blocks import IMAGE_BLOCKS_KWARG, image_blocks
from ..topology import SPTopology
from .media_split import encode_split

# The encoder's per-patch states of the whole batch (LLaVA: every layer's): not needed past the feature selection
_PATCH_STATES = ("last_hidden_state", "hidden_states", "attentions")


class MediaFeatures:
    """The pre-hook that gives each rank the encoder features of its own placeholder tokens."""

    def __init__(
        self, model: PreTrainedModel, topology: SPTopology, sharding: SequenceSharding, split_media: bool = False
    ):
        self.topology, self.sharding, self.split_media = topology, sharding, split_media
        self.exchanged = 0  # media kinds split over the ranks in the last forward (split media)
        self.token_ids = token_ids(model)
        self.mrope = uses_mrope(model)
        self.image_blocks = image_block_rule(model)  # Gemma3 / Gemma4: each image's tokens see each other
        self.video_spans = span_marked_video(model)  # GLM-5-Next: video frames at the image token, inside spans
        self.name = type(model).__name__
        base = vlm_base(model)
        self.mask_per_layer_type = type(base).__name__ in IMAGE_BLOCK_MODELS  # its masks: never built from a shard
        decoder = {id(p) for p in text_decoder(model).parameters()}
        self._encoder_params = [p for p in base.parameters() if id(p) not in decoder]
        self._handle = base.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def detach(self) -> None:
        self._handle.remove()

    def _before_forward(self, base, args, kwargs):
        if args:  # LLaVA-Next passes input_ids by position: named here, so the hook reads and rewrites them
            names = list(inspect.signature(base.forward).parameters)[: len(args)]
            kwargs, args = {**dict(zip(names, args, strict=True)), **kwargs}, ()
        media = [m for m in self.token_ids if kwargs.get(PIXELS[m]) is not None]
        check_positions(self.name, kwargs.get("position_ids"), self.mrope, bool(media))
        if kwargs.get("input_features") is not None:
            raise ValueError(
                f"{self.name} under SP got audio (input_features): its audio features are merged inside its forward, "
                "which takes no precomputed audio rows, so SP can't give each rank its own audio tokens' features. "
                "Train on audio with sp_size=1."
            )
        rule = self.image_blocks
        if rule is not None and kwargs.get(rule.types_key) is not None:  # the images of the whole rows
            types = kwargs[rule.types_key]
            full_types = self.sharding.unshard(all_gather_along(types, 1, self.topology.sp_group), 1)
            kwargs[IMAGE_BLOCKS_KWARG] = image_blocks(full_types, rule.media_types)
        if self.mask_per_layer_type and not isinstance(kwargs.get("attention_mask"), dict):  # not from the shard
            kwargs["attention_mask"] = dict.fromkeys(
                ("full_attention", "sliding_attention"), kwargs.get("attention_mask")
            )
        if not media:
            return args, kwargs
        if len(media) > 1 and shared_placeholder(self.token_ids) and self.video_spans is None:
            raise ValueError(
                f"{self.name} places image and video features at the same token (id {self.token_ids['image']}), "
                "so one batch can't hold both (its own forward refuses that on one device too): put images and "
                "videos in separate batches."
            )
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError(f"{self.name} under SP with media needs input_ids (the placeholders), not inputs_embeds.")
        group = self.topology.sp_group
        full = self._placeholders(input_ids, media)  # [m, b, s]: every rank, the same values
        positions = self.sharding.positions(full.shape[-1], self.topology.sp_rank).to(full.device)
        local = full[..., positions]  # [m, b, s/P]: this rank's shard
        outputs = dict(kwargs.get("mm_encoder_outputs") or {})
        self.exchanged = 0
        trainable = torch.is_grad_enabled() and any(p.requires_grad for p in self._encoder_params)
        for i, modality in enumerate(media):
            count = int(full[i].sum())
            with torch.set_grad_enabled(trainable):
                exchanged = encode_split(encode, base, modality, kwargs, count, group) if self.split_media else None
                if exchanged is None:  # whole media (or fewer media than ranks): every rank encodes every medium
                    encoded = encode(base, modality, kwargs)
                    rows = feature_rows(getattr(encoded, feature_field(encoded)))
                    deep = [feature_rows(level) for level in getattr(encoded, "deepstack_features", None) or []]
                else:  # split media: this rank's group encoded, the whole batch's rows exchanged
                    rows, deep, encoded = exchanged
                    self.exchanged += 1
            field = feature_field(encoded)  # pooler_output; Llama-4: last_hidden_state, projected in its forward
            split = _is_split(getattr(encoded, field))  # a tuple per medium (Qwen-VL, LLaVA) or one tensor (InternVL)
            rows = rows.reshape(-1, rows.shape[-1])
            if count != rows.shape[0]:
                raise ValueError(
                    f"{self.name}: the batch has {count} {modality} placeholder tokens but its {PIXELS[modality]} "
                    f"encode to {rows.shape[0]} feature rows; each {modality}'s placeholders must match its grid "
                    "(build the examples with the model's processor)."
                )
            rank = (full[i].flatten().cumsum(0) - 1).view_as(full[i])  # global placeholder index, row-major (b, s)
            index = rank[:, positions][local[i].bool()].to(rows.device)  # this rank's placeholders, in local order
            mine = rows.index_select(0, index)
            fields = {k: v for k, v in encoded.items() if k not in _PATCH_STATES}
            fields[field] = (mine,) if split else _like(getattr(encoded, field), mine)
            if deep:  # Qwen3-VL: the same rows of every deepstack level
                fields["deepstack_features"] = [(level.index_select(0, index),) for level in deep]
            outputs[modality] = type(encoded)(**fields)  # a new output: the old one's dict still holds every state
            kwargs[PIXELS[modality]] = None
        if self.video_spans is not None:  # its own mask would read the spans from the shard: merged here instead
            return args, merge_own_rows(base, kwargs, media, local, outputs)
        kwargs["mm_encoder_outputs"] = outputs
        return args, kwargs

    def _placeholders(self, input_ids: torch.Tensor, media: list[str]) -> torch.Tensor:
        """``[m, b, s]`` int32: each modality's placeholder tokens on the whole sequence (one all-gather of the
        shard's marks). GLM-5-Next's video frames are image tokens inside video start / end spans: told apart on the
        whole sequence, where every span is whole."""
        group = self.topology.sp_group
        if self.video_spans is None:
            local = torch.stack([input_ids == self.token_ids[m] for m in media]).to(torch.int32)
            return self.sharding.unshard(all_gather_along(local, 2, group), 2)
        start, end = self.video_spans
        marks = torch.stack([input_ids == t for t in (self.token_ids["image"], start, end)]).to(torch.int32)
        placeholder, starts, ends = self.sharding.unshard(all_gather_along(marks, 2, group), 2)
        in_video = starts.cumsum(-1) > ends.cumsum(-1)
        return torch.stack([placeholder * (in_video if m == "video" else ~in_video) for m in media]).to(torch.int32)


def merge_own_rows(base: torch.nn.Module, kwargs: dict, media: list[str], local: torch.Tensor, outputs: dict) -> dict:
    """``kwargs`` with this rank's ``inputs_embeds``: its tokens' embeddings, each modality's feature rows scattered
    at its placeholders (``local``) in order — the model's own merge (``masked_scatter`` of the pooled rows) with the
    masks of the whole sequence — and no ``input_ids`` or media left to merge."""
    embeds = base.get_input_embeddings()(kwargs["input_ids"])
    for i, modality in enumerate(media):
        rows = getattr(outputs[modality], feature_field(outputs[modality]))
        rows = torch.cat(rows, dim=0) if _is_split(rows) else rows.reshape(-1, rows.shape[-1])
        rows = rows.to(embeds.device, embeds.dtype)
        embeds = embeds.masked_scatter(local[i].bool()[..., None], rows)
    return {**kwargs, "input_ids": None, "inputs_embeds": embeds, "mm_encoder_outputs": None}


def encode(base: torch.nn.Module, modality: str, kwargs: dict):
    """The model's own encoder call (``get_image_features`` / ``get_video_features``) on every medium of the batch,
    with the batch's kwargs its signature names (grids, image sizes, feature-layer choices)."""
    fn = getattr(base, f"get_{modality}_features")
    params = inspect.signature(fn).parameters
    extra = {k: kwargs[k] for k in params if k in kwargs and k != PIXELS[modality] and kwargs[k] is not None}
    if "return_dict" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        extra["return_dict"] = True
    return fn(kwargs[PIXELS[modality]], **extra)


def check_positions(name: str, position_ids, mrope: bool, has_media: bool) -> None:
    """Multimodal rotary positions on a packed row need the text row (``[4, b, s]``): without it transformers
    silently falls back to positions that ignore documents or images. Raised before any collective."""
    if position_ids is None or position_ids.ndim < 3:
        if mrope and has_media:
            raise ValueError(
                f"{name} under SP got {'no' if position_ids is None else '1-D'} position_ids with media: its "
                "multimodal rotary positions must be computed per document on the whole row before sharding. Pack "
                "the examples with hf_sp_trainer.SPMultimodalCollator(model), which gives [4, batch, seq] positions."
            )
        return
    if position_ids.shape[0] != 4:
        raise ValueError(
            f"{name} under SP got position_ids of shape {tuple(position_ids.shape)}: a packed row needs "
            "[4, batch, seq] (a text row restarting at 0 per document, then the t / h / w rows); without the text "
            "row the documents can't be told apart. Use hf_sp_trainer.SPMultimodalCollator(model)."
        )


def _is_split(x) -> bool:
    return isinstance(x, (list, tuple))


def _like(pooled: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """This rank's rows shaped as the encoder's tensor: ``[media, tokens, dim]`` becomes ``[1, rows, dim]`` (one
    medium holding them), as merges iterate over media (LLaVA-Next-Video's videos) or index ``shape[1]``
    (Video-LLaVA's placeholder check); flat ``[rows, dim]`` stays flat. Every merge scatters by element count."""
    return mine[None] if pooled.dim() == 3 else mine
