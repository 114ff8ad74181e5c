"""Doge's dynamic-mask attention under SP (``hf_sp_trainer/attention/doge.py``), in process: the behaviour check of
the swapped forward with negative controls, its gradients (``A`` and ``dt_proj`` included) in query tiles, what SP
accepts and refuses of Doge (a ring; its product-key MoE; an unknown attention building its own mask)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.doge import modeling_doge

from hf_sp_trainer.attention import doge
from hf_sp_trainer.mixers.doge_checks import DOCS, document_mask, doge_attention_ok, doge_parts
from hf_sp_trainer.validate import validate_model_for_sp
from tests.family_harness import build_model, tiny_config
from tests.harness import EXACT

pytestmark = pytest.mark.unit  # in-process

ATTENTION = modeling_doge.DogeAttention


def _check() -> bool:
    return doge_attention_ok.__wrapped__(ATTENTION, ATTENTION.forward)


def test_check_passes_and_catches_what_it_guards(monkeypatch):
    """The installed forward passes; the top-k over the whole row (not the query's document), the ``dt`` bias
    dropped, every visible key kept (no top-k), or the window dropped, each fail."""
    assert _check()
    select, visible = doge.dynamic_selection, doge.visible_keys

    def whole_row(dt, seen, keep):  # transformers' top-k on a packed row without its documents' mask
        return select(dt, torch.ones_like(seen), keep) & seen[:, None]

    def no_bias(dt, selected):
        return torch.zeros(selected.shape).masked_fill(~selected, float("-inf"))

    def every_visible(dt, seen, keep):
        return seen[:, None].expand(-1, dt.shape[1], -1, -1)

    def no_window(docs, queries, window):
        return visible(docs, queries, None)

    for name, broken in [
        ("dynamic_selection", whole_row),
        ("dynamic_bias", no_bias),
        ("dynamic_selection", every_visible),
        ("visible_keys", no_window),
    ]:
        with monkeypatch.context() as m:
            m.setattr(doge, name, broken)
            assert not _check(), broken.__name__


def _output_and_grads(attn, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    attn.zero_grad(set_to_none=True)
    out = run()
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in attn.named_parameters()}


@pytest.mark.parametrize("window", [None, 7])
def test_gradients_in_query_tiles_match_each_document_alone(window, monkeypatch):
    """Tiles of 3 queries (recomputed in the backward) on two packed documents: the output and every parameter's
    gradient (``A``'s and ``dt_proj``'s non-zero) are the installed forward's on each document alone."""
    attn, rotary = doge_parts(ATTENTION, window)
    seq = DOCS[-1][1]
    hidden = torch.randn(1, seq, 32, generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(e - s) for s, e in DOCS])[None]
    bounds = torch.tensor([0, *(e for _, e in DOCS)])

    def alone():
        outs = []
        for s, e in DOCS:
            embeddings = rotary(hidden[:, s:e], torch.arange(e - s)[None])
            outs.append(ATTENTION.forward(attn, hidden[:, s:e], embeddings, document_mask(e - s, window))[0])
        return torch.cat(outs, dim=1)

    expected, expected_grads = _output_and_grads(attn, alone)
    monkeypatch.setattr(doge, "SCORE_BYTES", 4 * attn.config.num_attention_heads * seq * 3)
    with monkeypatch.context() as m:
        tiles = []
        m.setattr(doge, "_attend_tile", lambda q, *a, **kw: tiles.append(q.shape[2]) or _attend(q, *a, **kw))
        out, grads = _output_and_grads(
            attn, lambda: doge.doge_attention_forward(attn, hidden, rotary(hidden, positions), bounds, None)
        )
    assert set(tiles) <= {3, seq % 3 or 3} and len(tiles) >= 2 * -(-seq // 3)  # forward and recompute
    assert torch.allclose(out, expected, atol=1e-5)
    for name, grad in expected_grads.items():
        assert torch.allclose(grads[name], grad, rtol=EXACT, atol=1e-5), name
    assert grads["A"].abs().min() > 0 and grads["dt_proj.weight"].abs().max() > 0


_attend = doge._attend_tile


class OtherDynamicAttention(ATTENTION):
    """An attention building its own mask that SP doesn't know (Doge's, renamed)."""


def test_sp_accepts_ulysses_and_refuses_a_ring():
    model = build_model("doge", "DogeForCausalLM")
    assert validate_model_for_sp(model, 2) == (2, 1)
    with pytest.raises(ValueError, match="DogeAttention.*Ulysses SP only.*sp_ring_size=1"):
        validate_model_for_sp(model, 4, ring_size=2)


def test_product_key_moe_and_unknown_dynamic_masks_are_refused():
    """Doge's product-key MoE routes a token by other tokens' router logits: refused, naming it. An attention
    building its own mask that SP doesn't know (a subclass of Doge's, renamed) is refused too."""
    config = tiny_config("doge")
    config.is_moe, config.num_experts, config.num_experts_per_tok = True, 4, 2
    torch.manual_seed(0)
    moe = transformers.DogeForCausalLM(config)
    with pytest.raises(ValueError, match="DogeCDMoE.*reads other tokens' logits"):
        validate_model_for_sp(moe, 2)
    model = build_model("doge", "DogeForCausalLM")
    attn = model.model.layers[0].self_attn
    attn.__class__ = OtherDynamicAttention
    with pytest.raises(ValueError, match="OtherDynamicAttention.*computes its own mask"):
        validate_model_for_sp(model, 2)


def test_one_device_keeps_packed_documents_apart():
    """At sp_size 1 transformers' own forward runs: on a packed row its mask (from the packed ``position_ids``) is
    block-diagonal, so each query's top-k is over its own document's visible keys, as each document alone (with the
    crossed top-6 and window 7)."""
    model = build_model("doge", "DogeForCausalLM", crossed=True)
    assert {"keep_window_size", "sliding_window"} <= set(model.crossed_settings)
    ids = torch.randint(3, 64, (1, 31), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(e - s) for s, e in DOCS])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits
        alone = torch.cat([model(input_ids=ids[:, s:e]).logits for s, e in DOCS], dim=1)
    assert torch.allclose(packed, alone, atol=1e-5)


def test_outside_sp_the_swapped_forward_is_transformers():
    from hf_sp_trainer.mixers.swap import MODULE_ENTRIES

    attn, rotary = doge_parts(ATTENTION, 7)
    forward = getattr(ATTENTION.forward, "_hf_sp_original", ATTENTION.forward)
    entry = MODULE_ENTRIES["DogeAttention"][1](forward)
    hidden = torch.randn(1, 13, 32, generator=torch.Generator().manual_seed(2))
    embeddings, mask = rotary(hidden, torch.arange(13)[None]), document_mask(13, 7)
    with torch.no_grad():
        assert torch.equal(entry(attn, hidden, embeddings, mask)[0], forward(attn, hidden, embeddings, mask)[0])
