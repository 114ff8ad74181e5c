"""In-process checks of ``attention/position_rules.py``: the upstream behaviour it compensates (a contract: fails
when transformers changes it) and its refusals. The end-to-end exactness is in ``tests/test_length_settings.py``
and the family suite's crossed run."""

import pytest
import torch
from transformers import AttentionInterface

from hf_sp_trainer.attention.position_rules import (
    CHUNK_MARK,
    TEMPERATURE_MARK,
    WholeSequenceRope,
    chunk_layout,
    mark_position_rules,
    nope_temperature,
    position_rules,
    retune_temperature,
)
from hf_sp_trainer.documents import DocumentLayout
from tests.harness import tiny_model
from tests.test_length_settings import LONGROPE

pytestmark = pytest.mark.unit  # in-process


def test_llama4_scales_nope_queries_by_the_row_index():
    """Contract: Llama-4's NoPE layer scales its query by ``nope_temperature(arange(length))``, the row index of
    what it is given (what ``retune_temperature`` undoes), and its chunked layers are the ones ``layer_types`` names."""
    model = tiny_model("llama4", floor_scale=4, attn_scale=1.0).eval()
    seen = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = query.detach().clone()
        return torch.zeros_like(query).transpose(1, 2), None

    AttentionInterface.register("capture_queries", capture)
    model.set_attn_implementation("capture_queries")
    attention = model.model.layers[3].self_attn
    assert not attention.use_rope and attention.attn_temperature_tuning
    hidden = torch.randn(1, 11, model.config.hidden_size)
    with torch.no_grad():
        attention(hidden, None, None)
        raw = attention.q_proj(hidden).view(1, 11, -1, attention.head_dim).transpose(1, 2)
    expected = raw * nope_temperature(torch.arange(11), 4.0, 1.0)[None, None, :, None]
    torch.testing.assert_close(seen[3], expected)
    rules = position_rules(model.model, model.config)
    assert {m.layer_idx for m, (chunk, _) in rules.items() if chunk and hasattr(m, "q_proj")} == {0, 1, 2}
    assert {m.layer_idx for m, (_, temp) in rules.items() if temp} == {3}


def test_retune_temperature_moves_the_scale_to_document_positions():
    module = torch.nn.Module()
    setattr(module, TEMPERATURE_MARK, (4.0, 1.0))
    raw = torch.randn(1, 2, 6, 8)
    local = raw * nope_temperature(torch.arange(6), 4.0, 1.0)[None, None, :, None]  # what the module computed
    positions = torch.tensor([[9, 10, 0, 1, 2, 3]])  # a document continued from the shard before, a new one
    expected = raw * nope_temperature(positions, 4.0, 1.0)[:, None, :, None]
    torch.testing.assert_close(retune_temperature(module, local, positions), expected)
    assert retune_temperature(torch.nn.Module(), local, positions) is local


def test_chunk_layout_cuts_documents_at_chunk_boundaries():
    layout = DocumentLayout.from_position_ids(torch.cat([torch.arange(13), torch.arange(9)])[None])
    assert chunk_layout(layout, 4).segments == [[(0, 4), (4, 8), (8, 12), (12, 13), (13, 17), (17, 21), (21, 22)]]
    assert chunk_layout(layout, None) is layout


def test_position_rules_refuse_what_they_cant_place():
    model = tiny_model("llama4", attention_chunk_size=8)
    for m in model.model.modules():
        if hasattr(m, "layer_idx"):
            del m.layer_idx
    with pytest.raises(ValueError, match="no module names its layer_idx"):
        position_rules(model.model, model.config)
    model = tiny_model("llama4")
    del model.model.layers[3].self_attn.floor_scale
    with pytest.raises(ValueError, match="floor_scale"):
        position_rules(model.model, model.config)
    model = tiny_model("llama")
    mark_position_rules(model.model, model.config)
    assert all(getattr(m, CHUNK_MARK) is None and getattr(m, TEMPERATURE_MARK) is None for m in model.model.modules())


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("llama", dict(max_position_embeddings=24, rope_parameters=dict(rope_type="dynamic", factor=8.0))),
        ("phi3", dict(rope_parameters=LONGROPE, original_max_position_embeddings=24)),
    ],
)
def test_runtime_length_rope_follows_the_longest_position(family, overrides):
    """Contract: dynamic NTK / longrope frequencies follow the longest position of the call, along dim -2 of the
    outputs; so one extra position (the whole sequence's longest) gives a shard the whole sequence's values, and
    without it the shard's own differ (what SP would get from its shard alone)."""
    rope = tiny_model(family, **overrides).model.rotary_emb
    x = torch.zeros(1, 1, 16)
    whole = [t[:, :12] for t in rope(x, torch.arange(40)[None])]
    hooks = WholeSequenceRope(group=None).attach(torch.nn.ModuleList([rope]))
    assert len(hooks) == 2
    with_longest = rope(x, torch.cat([torch.arange(12), torch.tensor([39])])[None])  # the pre-hook adds none more
    for hook in hooks:
        hook.remove()
    for got, want in zip(with_longest, whole, strict=True):
        torch.testing.assert_close(got[:, :12], want)
    alone = rope(x, torch.arange(12)[None])
    assert float((alone[0] - whole[0]).abs().max()) > 1e-3


def test_runtime_length_rope_hook_takes_a_call_without_positions():
    """A rank may call a rotary with no positions (DeepSeek-V4's compressor when no window ends in its shard): the hook
    still contributes to the SP group's max (its all-reduce runs on every rank; a crash here left the others waiting
    forever) and the call returns nothing."""
    rope = tiny_model("phi3", rope_parameters=LONGROPE, original_max_position_embeddings=24).model.rotary_emb
    hooks = WholeSequenceRope(group=None).attach(torch.nn.ModuleList([rope]))
    cos, sin = rope(torch.zeros(1, 0, 16), torch.zeros(1, 0, dtype=torch.long))
    for hook in hooks:
        hook.remove()
    assert cos.shape[-2] == 0 and sin.shape[-2] == 0


def test_runtime_length_rope_with_multimodal_positions():
    """The same for Qwen2-VL's multimodal rope (positions ``[3, b, s]``, sections merged inside the rotary)."""
    from tests.multimodal_harness import build_vlm

    text = build_vlm("qwen2_vl").config.text_config
    rope = {**text.rope_parameters, "rope_type": "dynamic", "factor": 4.0}
    config = type(text)(**{**text.to_dict(), "rope_parameters": rope, "max_position_embeddings": 24})
    rotary = type(build_vlm("qwen2_vl").model.language_model.rotary_emb)(config)
    x, positions = torch.zeros(1, 1, 16), torch.arange(40)[None, None].expand(3, 1, 40)
    whole = [t[..., :12, :] for t in rotary(x, positions)]
    hooks = WholeSequenceRope(group=None).attach(torch.nn.ModuleList([rotary]))
    with_longest = rotary(x, torch.cat([positions[..., :12], positions[..., 39:]], dim=-1))
    for hook in hooks:
        hook.remove()
    for got, want in zip(with_longest, whole, strict=True):
        torch.testing.assert_close(got[..., :12, :], want)
    assert float((rotary(x, positions[..., :12])[0] - whole[0]).abs().max()) > 1e-3
