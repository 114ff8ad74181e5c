"""A character-level tokenizer built offline (no hub access), with a chat template for conversational data."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}</s>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer(extra_special: dict[str, int] | None = None) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character plus special tokens (pad 0, bos 1, eos 2, unk 3); ``extra_special``:
    more special tokens at given ids (a VLM's ``<image>``)."""
    chars = sorted(set(string.printable))
    extra_special = extra_special or {}
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)} | extra_special
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=[*SPECIAL_TOKENS[4:], *extra_special],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
