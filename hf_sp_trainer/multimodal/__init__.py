"""Vision-language models under SP: the text decoder runs sequence-parallel, the encoders whole on every rank
(``features``), or each rank encodes its share of the media (``media_split``). What a VLM is made of, and which are
refused, is a model fact (``model.vlm``)."""

from ..model.vlm import check_multimodal, is_multimodal, text_decoder

__all__ = ["check_multimodal", "is_multimodal", "text_decoder"]
