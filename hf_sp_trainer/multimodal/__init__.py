"""Vision-language models under SP: the text decoder runs sequence-parallel, the encoders whole on every rank."""

from .parts import check_multimodal, is_multimodal, text_decoder

__all__ = ["check_multimodal", "is_multimodal", "text_decoder"]
