"""A tiny random LLaVA (a CLIP tower and a Llama decoder) with its processor, built offline, and conversations in
TRL's vision format (``messages`` + ``images``): what the VLM recipe's CPU smoke run and the VLM tests train on.
Needs pillow (the ``vision`` or ``test`` extra)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 128
IMAGE_TOKEN_ID = 120
IMAGE_SIZE, PATCH = 8, 2  # 16 patches: each image 16 placeholder tokens (the CLS feature dropped)
VISION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "</s>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# The tiny text decoder of the VLMs here and in the tests (with a model_type: llama, qwen2, ...)
TINY_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_llava_config():
    from transformers import LlavaConfig

    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )
    seq = (IMAGE_SIZE // PATCH) ** 2
    text = dict(TINY_TEXT, model_type="llama")
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, image_seq_length=seq)


def tiny_llava_processor():
    """``LlavaProcessor``: the project's character tokenizer plus ``<image>``, a PIL CLIP image processor for 8x8
    images and a chat template with generation markers (for ``assistant_only_loss``)."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from .tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer({"<image>": IMAGE_TOKEN_ID})
    tokenizer.chat_template = None  # the processor's template, below
    size = {"shortest_edge": IMAGE_SIZE}
    images = CLIPImageProcessorPil(size=size, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        chat_template=VISION_TEMPLATE,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    )


def vision_conversations(n: int = 8, seed: int = 0, images_per_row: int = 3) -> list[dict]:
    """``n`` rows of TRL's conversational vision format: 0 to ``images_per_row - 1`` random 8x8 images in the user
    turn (one placeholder each), random text, an assistant answer."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = i % images_per_row
        images = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)) for _ in range(k)]
        question = "".join(rng.choice(list("abcdefgh "), 3 + 2 * i))
        answer = "".join(rng.choice(list("xyz uvw"), 4 + (5 * i) % 11))
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        messages = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        rows.append({"messages": messages, "images": images})
    return rows


def write_tiny_vlm_assets(out: str | Path, num_rows: int = 16, seed: int = 0) -> Path:
    """``out/vlm`` (model + processor, loadable by id like a hub checkpoint) and ``out/vision.parquet``."""
    import torch
    import transformers
    from datasets import Dataset

    root = Path(out)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(tiny_llava_config())
    model.save_pretrained(root / "vlm")
    tiny_llava_processor().save_pretrained(root / "vlm")
    Dataset.from_list(vision_conversations(num_rows, seed)).to_parquet(str(root / "vision.parquet"))
    return root
