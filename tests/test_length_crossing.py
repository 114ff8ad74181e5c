"""The crossing of length-dependent settings (``tests/length_crossing.py``), in process: every length-like setting
of the installed transformers' decoders is classified, and the crossing is found by attributes and rope parameters."""

from __future__ import annotations

import warnings

import pytest

from tests.family_harness import build_model, families
from tests.length_crossing import (
    CROSSED,
    LENGTH_LIKE,
    NOT_THRESHOLDS,
    OF_REFUSED_FAMILIES,
    ROPE_KEYS,
    cross_config,
    describe,
    rope_dims,
)

pytestmark = pytest.mark.unit  # in-process


def _decoder_configs():
    """``(model type, decoder config)`` of every causal LM and the text config of every image-text-to-text model."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    types = {f.model_type for f in families()} | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    for model_type in sorted(types):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = CONFIG_MAPPING[model_type]()
            except Exception:  # noqa: BLE001 - a config without defaults (the family table says "can't build")
                continue
        config.allow_global_per_layer_attribute_access = True
        yield model_type, config
        text = getattr(config, "text_config", None)
        if text is not None:
            yield f"{model_type}.text_config", text


def test_every_length_like_setting_is_classified():
    """A new release's new window / chunk / top-k / floor setting fails here until it is crossed (``CROSSED``) or
    classified (``NOT_THRESHOLDS``, ``OF_REFUSED_FAMILIES``) in ``tests/length_crossing.py``."""
    known = set(CROSSED) | set(NOT_THRESHOLDS) | set(OF_REFUSED_FAMILIES) | ROPE_KEYS
    unknown: dict[str, list[str]] = {}
    for model_type, config in _decoder_configs():
        for name, value in config.to_dict().items():
            if isinstance(value, dict) or isinstance(value, bool) or not isinstance(value, (int, float, type(None))):
                continue
            if LENGTH_LIKE.search(name) and name not in known and not name.startswith("_"):
                unknown.setdefault(name, []).append(model_type)
    assert not unknown, f"classify these length-like settings in tests/length_crossing.py: {unknown}"


@pytest.mark.parametrize(
    "model_type, class_name, expected",
    [
        ("llama", "LlamaForCausalLM", {"rope longrope threshold": 24}),
        ("qwen2", "Qwen2ForCausalLM", {"sliding_window": 7, "rope longrope threshold": 24}),
        ("phi3", "Phi3ForCausalLM", {"sliding_window": 7, "original_max_position_embeddings": 24}),
        ("llama4_text", "Llama4ForCausalLM", {"attention_chunk_size": 8, "floor_scale": 4, "attn_scale": 1.0}),
        ("gpt_oss", "GptOssForCausalLM", {"sliding_window": 7, "rope yarn threshold": 8}),
        ("gemma4_text", "Gemma4ForCausalLM", {"sliding_window": 7, "rope[sliding_attention] dynamic threshold": 24}),
        ("granitemoehybrid", "GraniteMoeHybridForCausalLM", {"mamba_chunk_size": 8}),
        ("gpt2", "GPT2LMHeadModel", {}),
    ],
)
def test_crossing_is_found_by_attributes(model_type: str, class_name: str, expected: dict) -> None:
    """Windows, chunks, temperature floors, kernel blocking and rope thresholds: each found where the config has
    it, the runtime rope falling back to dynamic NTK where the config refuses longrope (Gemma4), nothing where
    nothing depends on length (GPT-2's learned positions)."""
    model = build_model(model_type, class_name)
    config, crossed = cross_config(model.config, rope_dims(model))
    assert expected.items() <= crossed.items(), crossed
    if not expected:
        assert config is None and crossed == {}
        return
    crossed_model = build_model(model_type, class_name, crossed=True)
    assert crossed_model.crossed_settings == crossed, describe(crossed)
    for name, value in expected.items():
        if " " not in name:
            assert getattr(crossed_model.config, name) == value
