"""Packing multimodal examples into one padding-free row, positions computed per document by the model itself."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ..model.vlm import (
    PADDING_POSITION,
    PIXELS,
    rope_index,
    row_newline,
    shared_placeholder,
    span_marked_video,
    temporal_merge,
    token_ids,
    uses_mrope,
    vlm_base,
)
from ..sharding import IGNORE_INDEX, MEDIA_KEYS

TOKEN_KEYS = ("input_ids", "labels", "mm_token_type_ids")
MODALITY_TYPE = {"image": 1, "video": 2}  # mm_token_type_ids: text 0, image 1, video 2
# Per-token inputs of some base models, from their processors, packed like input_ids where the base's forward takes
# them (zeros for an example without): ERNIE-4.5-VL's moe_mm_token_type_ids (which tokens its vision experts take)
PER_TOKEN_KEYS = ("moe_mm_token_type_ids",)


class SPMultimodalCollator:
    """Pack multimodal examples (a processor's output per example: ``input_ids``, ``labels``, ``pixel_values``,
    ``image_grid_thw``, ...) into one row.

    - ``input_ids`` / ``labels`` / ``mm_token_type_ids`` are concatenated; each document's first label is ``-100``
      (``token_type_ids`` for a model that takes those instead: Gemma3, whose image mask they drive); so are the
      ``PER_TOKEN_KEYS`` the model takes;
    - media tensors are concatenated in the same order, so the k-th placeholder of the row is the k-th feature row;
    - positions restart per document: the model's own ``get_rope_index`` on each document alone, with a text row
      in front (``[4, 1, S]``), for multimodal-rope models (Qwen-VL, GLM-4V); ``[1, S]`` otherwise (LLaVA-style).

    The row is what one device trains on as well; ``hf_sp_trainer.sharding`` splits it for SP.
    """

    def __init__(self, model: torch.nn.Module):
        base = vlm_base(model)
        if base is None:
            raise ValueError(f"SPMultimodalCollator needs a vision-language model; got {type(model).__name__}.")
        self.token_ids = token_ids(model)
        self._base = base
        self._mrope = uses_mrope(model)
        vision = getattr(model.config, "vision_config", None)
        self._merge = getattr(vision, "spatial_merge_size", None)
        self._newline = row_newline(base)  # HY-V4-VL: one more placeholder per merged row of patches
        self._video_spans = span_marked_video(model)  # GLM-5-Next: video frames at the image token, inside spans
        self._pooling = getattr(vision, "pooling_kernel_size", None)  # Gemma4: patches pooled k x k per feature
        forward = inspect.signature(type(base).forward).parameters
        takes_plain = "token_type_ids" in forward and "mm_token_type_ids" not in forward
        self._types_key = "token_type_ids" if takes_plain else "mm_token_type_ids"  # Gemma3: its image mask's
        self.token_keys = (*TOKEN_KEYS, *(k for k in PER_TOKEN_KEYS if k in forward))

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        docs = [self._document(f) for f in features if len(f["input_ids"])]
        if not docs:
            raise ValueError("SPMultimodalCollator received a batch in which every example is empty.")
        batch = {key: torch.cat([d[key] for d in docs]).unsqueeze(0) for key in self.token_keys}
        batch["position_ids"] = torch.cat([d["position_ids"] for d in docs], dim=-1)
        _check_image_counts(docs)
        for key in MEDIA_KEYS:
            values = [d[key] for d in docs if d.get(key) is not None]
            if values:
                batch[key] = concat_media(values, key)
        batch[self._types_key] = batch.pop("mm_token_type_ids")
        return batch

    def _document(self, feature: dict[str, Any]) -> dict[str, Any]:
        ids = torch.as_tensor(feature["input_ids"], dtype=torch.long).flatten()
        labels = feature.get("labels")
        labels = ids.clone() if labels is None else torch.as_tensor(labels, dtype=torch.long).flatten()
        labels[0] = IGNORE_INDEX  # no document predicts the next one
        media = {k: torch.as_tensor(feature[k]) for k in MEDIA_KEYS if feature.get(k) is not None}
        doc = {"input_ids": ids, "labels": labels, "mm_token_type_ids": self._types(ids, media)} | media
        for key in self.token_keys[len(TOKEN_KEYS) :]:
            value = feature.get(key)
            doc[key] = torch.zeros_like(ids) if value is None else torch.as_tensor(value, dtype=torch.long).flatten()
            if len(doc[key]) != len(ids):
                raise ValueError(f"An example has {len(ids)} input_ids but {len(doc[key])} {key}.")
        self._check_grids(doc)
        doc["position_ids"] = self._positions(doc)
        return doc

    def _types(self, ids: torch.Tensor, media: dict[str, torch.Tensor]) -> torch.Tensor:
        """``mm_token_type_ids`` from the placeholders; where images and videos share one token, from which of the two
        the example holds (GLM-4V) or from the video start / end tokens around them (GLM-5-Next, as its processor)."""
        types = torch.zeros_like(ids)
        if self._video_spans is not None:
            start, end = self._video_spans
            in_video = (ids == start).cumsum(0) > (ids == end).cumsum(0)
            placeholder = ids == self.token_ids["image"]
            types[placeholder & ~in_video] = MODALITY_TYPE["image"]
            types[placeholder & in_video] = MODALITY_TYPE["video"]
            return types
        present = [m for m in self.token_ids if PIXELS[m] in media]
        if shared_placeholder(self.token_ids) and len(present) > 1:
            raise ValueError(
                f"An example holds images and videos, whose placeholders share token id {self.token_ids['image']} "
                "in this model, so they can't be told apart (its own forward refuses them together too)."
            )
        for modality, token in self.token_ids.items():
            if modality in present or not shared_placeholder(self.token_ids):
                types[ids == token] = MODALITY_TYPE[modality]
        return types

    def _check_grids(self, doc: dict[str, Any]) -> None:
        """Each document's placeholders match its grids (``t * h * w / merge**2`` tokens per image / video,
        ERNIE-4.5-VL's videos ``/ temporal_merge``; HY-V4-VL's ``+ t * h / merge`` row newlines) or its patch
        positions (Gemma4: ``patches / k**2`` per image / frame, padding patches at -1)."""
        for modality in self.token_ids:
            grid, positions = doc.get(f"{modality}_grid_thw"), doc.get(f"{modality}_position_ids")
            if self._merge:
                name, shown = f"{modality}_grid_thw", [] if grid is None else grid.tolist()
                per_row = self._merge**2 * temporal_merge(self._base.config, modality)  # ERNIE-4.5-VL: frame pairs
                rows = 0 if grid is None else int((grid.prod(-1) // per_row).sum())
                rows += 0 if grid is None else self._newline * int((grid[:, 0] * (grid[:, 1] // self._merge)).sum())
            elif self._pooling:
                real = [] if positions is None else (positions != PADDING_POSITION).all(-1).sum(-1).tolist()
                name, shown = f"{modality}_position_ids", f"with {real} real patches"
                rows = sum(n // self._pooling**2 for n in real)
            else:
                continue
            placeholders = int((doc["mm_token_type_ids"] == MODALITY_TYPE[modality]).sum())
            if placeholders != rows:
                raise ValueError(
                    f"An example has {placeholders} {modality} placeholder tokens but its {name} {shown} gives "
                    f"{rows} feature rows; build it with the processor."
                )

    def _positions(self, doc: dict[str, Any]) -> torch.Tensor:
        n = len(doc["input_ids"])
        text = torch.arange(n).view(1, 1, n)
        if not self._mrope:
            return text[0]  # [1, n]
        has_media = bool(doc["mm_token_type_ids"].any())
        if not has_media:
            return text.expand(4, 1, n).clone()  # text only: every row counts 0, 1, ...
        inputs = doc | {"mm_token_type_ids": doc["mm_token_type_ids"][None]}
        return torch.cat([text, rope_index(self._base, doc["input_ids"][None], inputs)])  # [4, 1, n]


def _check_image_counts(docs: list[dict[str, Any]]) -> None:
    """LLaVA-OneVision's ``batch_num_images`` (per example: several images skip the tiles) must come with every
    example that has images and count them; concatenated per document, it then lines up with the packed images."""
    if not any(d.get("batch_num_images") is not None for d in docs):
        return
    for i, d in enumerate(docs):
        images = 0 if d.get("pixel_values") is None else d["pixel_values"].shape[0]
        counted = None if d.get("batch_num_images") is None else int(d["batch_num_images"].sum())
        if counted != images and (images or counted):
            raise ValueError(
                f"Example {i} has {images} images but batch_num_images {counted}: give every example the "
                "processor's batch_num_images (or none of them)."
            )


def concat_media(values: list[torch.Tensor], key: str = "") -> torch.Tensor:
    """Concatenate per-example media tensors (of input ``key``) along the first dim; where their other dims differ
    (LLaVA-Next's ``[images, tiles, 3, h, w]`` with a different tile count per example), pad them first, as the
    processor pads a batch: zeros (the model reads the real extent from ``image_sizes``), or -1 for Gemma4's patch
    positions (its padding patches)."""
    pad = PADDING_POSITION if key.endswith("_position_ids") else 0
    if len({v.shape[1:] for v in values}) > 1:
        most = [max(v.shape[d] for v in values) for d in range(1, values[0].ndim)]
        values = [
            torch.nn.functional.pad(
                v, [x for d in reversed(range(1, v.ndim)) for x in (0, most[d - 1] - v.shape[d])], value=pad
            )
            for v in values
        ]
    return torch.cat(values)


class SPVisionSFTCollator:
    """TRL's vision collator (messages + images through the processor and its chat template, labels masked as TRL
    masks them) applied to each example alone, then ``SPMultimodalCollator``: one padding-free row whose tokens, labels
    and media are exactly those of TRL's padded batch."""

    def __init__(self, processor_collator, packer: SPMultimodalCollator):
        self.processor_collator, self.packer = processor_collator, packer

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        features = []
        for example in examples:
            one = self.processor_collator([dict(example)])  # a copy: TRL's collator rewrites "image" in place
            keep = one["attention_mask"][0].bool()
            feature = {k: one[k][0][keep] for k in ("input_ids", "labels")}
            feature |= {k: one[k][0][keep] for k in PER_TOKEN_KEYS if one.get(k) is not None}
            features.append(feature | {k: one[k] for k in MEDIA_KEYS if one.get(k) is not None})
        return self.packer(features)
