"""Llama-4's VLM (``Llama4ForConditionalGeneration``) in the multimodal matrix: its tiny config, its processor's
image layout, and what its length settings do to the reference.

Text decoder (four layers): layers 0-2 rotary, chunked attention in chunks of ``CHUNK`` tokens (chunks cut through
images and documents), layer 1 a MoE (four experts, top 1, a shared expert); layer 3 NoPE, full attention, its query
scaled by the temperature ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` with ``floor_scale`` ``FLOOR``
and ``attn_scale`` 1 (it steps every four positions). Vision: 16 x 16 tiles of 2 x 2 patches (and a CLS token), two
layers, pixel-shuffled by 0.5 to ``TILE`` features a tile, projected to the text width in the model's forward.

Layout (``Llama4Processor._prompt_split_image``): an image of ``rows x cols`` tiles is ``<|image_start|>``, then,
when it has more than one tile, each row of tiles (``TILE`` ``<|patch|>`` a tile, ``<|tile_x_separator|>`` between
tiles, ``<|tile_y_separator|>`` after the row), then ``<|image|>`` and the global tile's ``TILE`` ``<|patch|>``, then
``<|image_end|>``. Its ``pixel_values`` are ``[tiles (the global one last), 3, 16, 16]``, concatenated over images.
The model places the projected features at the ``<|patch|>`` tokens (``image_token_id``) in order.

transformers 5.24.0's ``Llama4ForConditionalGeneration.forward`` fails on every call with a dict output (it reads
``image_outputs`` from its language model's output, which has none: ``test_llama4_forward_needs_the_tuple_path``
pins it); its tuple path runs (``config.return_dict=False``, called with ``return_dict=True``: ``capture_outputs``
then leaves the tuple alone). The matrix runs the reference and SP through that path (``forward_logits``), the
Trainer case with ``return_dict=True`` in every batch (``with_return_dict``: the loss is the tuple's first item).
"""

from __future__ import annotations

import math

import torch

PATCH_TOKEN, IMAGE_START, IMAGE_END = 120, 122, 123  # image_token_id: the feature rows land here
IMAGE_TOKEN, TILE_X, TILE_Y = 124, 125, 126  # text tokens of the layout (no features)
TILE_PIXELS, TILE = 16, 16  # a tile: 16 x 16 pixels, 8 x 8 patches, pixel-shuffled to 4 x 4 features
CHUNK, FLOOR = 8, 4  # attention_chunk_size, floor_scale (transformers' defaults: 8192 and 8192)


def llama4_config(chunk: int = CHUNK, floor: int = FLOOR):
    from transformers import Llama4Config

    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  image_size=TILE_PIXELS, patch_size=2, pixel_shuffle_ratio=0.5, projector_input_dim=64,
                  projector_output_dim=64, vision_output_dim=64)  # fmt: skip
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_layers=[1], num_local_experts=4,
                attention_chunk_size=chunk, floor_scale=floor, attn_scale=1.0, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)  # fmt: skip
    config = Llama4Config(vision_config=vision, text_config=text, image_token_index=PATCH_TOKEN,
                          boi_token_index=IMAGE_START, eoi_token_index=IMAGE_END)  # fmt: skip
    layer_types = config.text_config.layer_types
    assert layer_types == ["chunked_attention"] * 3 + ["full_attention"], layer_types  # layer 3: NoPE
    config.return_dict = False  # the tuple path (module docstring)
    return config


def llama4_tiles(h: int, w: int) -> tuple[int, int]:
    """The tile grid of a layout's ``(h, w)`` medium: 4 x 4 is 2 x 1 tiles, 4 x 6 is 2 x 2, 2 x 2 a single tile."""
    return max(1, h // 2), max(1, math.ceil(w / 4))


def llama4_image(h: int, w: int, g: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """An image's tokens and its ``[tiles, 3, 16, 16]`` pixel values, as Llama-4's processor lays them out."""
    rows, cols = llama4_tiles(h, w)
    ids = [IMAGE_START]
    if rows * cols > 1:
        for _ in range(rows):
            for x in range(cols):
                ids += [PATCH_TOKEN] * TILE + ([TILE_X] if x < cols - 1 else [])
            ids.append(TILE_Y)
    ids += [IMAGE_TOKEN] + [PATCH_TOKEN] * TILE + [IMAGE_END]
    tiles = rows * cols + (rows * cols > 1)  # and the global tile
    return ids, torch.randn(tiles, 3, TILE_PIXELS, TILE_PIXELS, generator=g)


def forward_logits(model, **inputs) -> torch.Tensor:
    """The logits of the model's forward: Llama-4's tuple path (``(logits, cache)``), everyone else's output."""
    out = model(**inputs, return_dict=True)
    return out.logits if hasattr(out, "logits") else out[0]


def with_return_dict(collator):
    """``collator``'s batches with ``return_dict=True``: the Trainer calls Llama-4's tuple path (``model(**batch)``)
    and takes the loss as the tuple's first item."""

    def collate(features):
        return {**collator(features), "return_dict": True}

    return collate


def llama4_reference_gaps(layout: str = "mixed") -> dict[str, float]:
    """Negative controls: how far the reference (each document alone) moves when the chunks, the temperature or both
    are taken back to transformers' defaults (8192: no chunk boundary, temperature 1 on these rows)."""
    from tests.multimodal_harness import LAYOUTS, _instantiate_vlm, make_examples, reference, worst_error

    examples = make_examples(LAYOUTS[layout], "llama4")
    ref = reference(_instantiate_vlm("llama4", llama4_config(), 0), examples)
    settings = {"chunk": (8192, FLOOR), "temperature": (CHUNK, 8192), "both": (8192, 8192)}
    out = {}
    for name, (chunk, floor) in settings.items():
        other = reference(_instantiate_vlm("llama4", llama4_config(chunk, floor), 0), examples)
        out[name] = worst_error(ref, other)[0]
    return out
