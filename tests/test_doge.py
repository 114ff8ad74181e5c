"""Doge's dynamic-mask attention under SP (``hf_sp_trainer/attention/doge.py``), in process: the behaviour check of
the swapped forward with negative controls, its gradients (``A`` and ``dt_proj`` included) in query tiles, what SP
accepts (a ring: a ring portion of its queries) and refuses of Doge (its product-key MoE; an unknown attention
building its own mask; attention dropout, on every rank)."""

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


def _dropout_refusals() -> list[str]:
    """What an SP forward in training of Doge and DeepSeek-V4 with ``attention_dropout=0.1`` raises on this rank."""
    import torch.distributed as dist

    from hf_sp_trainer import apply_sequence_parallel
    from tests.harness import tiny_model

    dist.init_process_group("gloo")
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "position_ids": torch.arange(40)[None]}
    raised = []
    for family, attn in (("doge", "sdpa"), ("deepseek_v4", "eager")):
        model = tiny_model(family, attn=attn, attention_dropout=0.1).train()
        with apply_sequence_parallel(model, 2) as sp:
            try:
                model(**sp.shard_batch(batch))
                raised.append("no error")
            except ValueError as exc:
                raised.append(str(exc))
    dist.barrier()
    return raised


@pytest.mark.dist
def test_attention_dropout_is_refused_on_every_rank():
    """Doge's and DeepSeek-V4's SP attention recompute their tiles in the backward and have no dropout: training with
    ``attention_dropout`` raises on every rank alike (nothing hangs), naming the class and the fix."""
    from tests.harness import run_distributed, unwrap_results

    for raised in unwrap_results(run_distributed(2, _dropout_refusals, timeout=300)):
        for name, message in zip(("DogeAttention", "DeepseekV4Attention"), raised, strict=True):
            assert message == f"{name} under sequence parallelism has no attention dropout: set attention_dropout=0."


def test_sp_accepts_ulysses_and_a_ring():
    model = build_model("doge", "DogeForCausalLM")
    assert validate_model_for_sp(model, 2) == (2, 1)
    assert validate_model_for_sp(model, 4, ring_size=2) == (2, 2)


def test_a_ring_portion_of_the_queries_gets_those_rows_of_the_whole():
    """With a ring a rank attends its zigzag portion of the queries, at their whole-sequence positions, to the whole
    sequence's K, V and ``dt`` (``dsa.ring_gather``): those rows of the whole output, the whole q gradient's rows,
    and k / v / dt gradients that sum over the portions to the whole one's (top-3 and a window of 5 binding)."""
    from hf_sp_trainer.sharding import SequenceSharding

    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, 4, 16, 8, generator=gen), *(torch.randn(1, 2, 16, 8, generator=gen) for _ in range(2))]
    leaves.append(torch.rand(1, 2, 16, generator=gen) * 3)  # dt
    bounds, probe = torch.tensor([0, 7, 16]), torch.randn(1, 16, 4, 8, generator=gen)

    def run(queries):
        q, k, v, dt = (t.clone().requires_grad_() for t in leaves)
        rows = slice(None) if queries is None else queries
        out = doge.dynamic_mask_attention(q[:, :, rows], k, v, dt, bounds, 0.3, 3, 5, queries)
        (out * probe[:, rows]).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad, dt.grad

    whole = run(None)
    assert whole[4].abs().max() > 0
    portions = [SequenceSharding(2, 2).positions(16, rank) for rank in range(2)]
    parts = [run(rows) for rows in portions]
    for rows, (out, dq, *_) in zip(portions, parts, strict=True):
        assert torch.allclose(out, whole[0][:, rows], atol=1e-6)
        assert torch.allclose(dq[:, :, rows], whole[1][:, :, rows], atol=1e-6)
    for i in (2, 3, 4):
        assert torch.allclose(parts[0][i] + parts[1][i], whole[i], atol=1e-6)


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


def _packed_and_padded(model, documents: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One device's logits of ``documents`` as one position_ids-packed row and as right-padded rows, one each."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": d} for d in documents])
    longest = max(map(len, documents))
    rows = torch.tensor([d + [0] * (longest - len(d)) for d in documents])
    mask = torch.tensor([[1] * len(d) + [0] * (longest - len(d)) for d in documents])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        padded = model(input_ids=rows, attention_mask=mask).logits
    return packed, torch.cat([padded[i, : len(d)] for i, d in enumerate(documents)])


def test_trainer_cases_tiny_doge_acts_and_ties_only_on_repeated_tokens():
    """The Trainer-level cases' tiny Doge (tests/harness.py: top-6, window 12, ``A`` and ``dt_proj`` drawn): its top-k
    and its window each change the loss. Its first layer's bias is a function of the token alone, so a token repeated
    inside a window ties (to round-off), and torch.topk breaks the tie by the row's layout and the host's kernel: on
    one device the packed and the padded rows of the same documents may differ (by 0.1 on AVX-512 here, not at all
    under ``ATEN_CPU_CAPABILITY=avx2``); with no token twice they agree to round-off on every host (what
    ``distinct_tokens`` gives the cases)."""
    from tests.harness import synthetic_dataset, tiny_model

    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def loss(**overrides) -> float:
        with torch.no_grad():
            return tiny_model("doge", **overrides)(input_ids=ids, labels=ids).loss.item()

    base = loss()
    assert abs(loss(keep_window_size=10**6) / base - 1) > 10 * EXACT
    assert abs(loss(sliding_window=None) / base - 1) > 10 * EXACT
    model = tiny_model("doge")
    repeated = [row["input_ids"] for row in synthetic_dataset(3, seed=0)]
    distinct = [row["input_ids"] for row in synthetic_dataset(3, seed=0, distinct=True)]
    assert any(len(set(d)) < len(d) for d in repeated) and all(len(set(d)) == len(d) for d in distinct)
    doc = next(d for d in repeated if len(set(d)) < len(d))
    i, j = next((i, j) for j in range(len(doc)) for i in range(j) if doc[i] == doc[j])
    bias = []
    handle = model.model.layers[0].self_attn.dt_proj.register_forward_hook(lambda m, a, out: bias.append(out[0]))
    with torch.no_grad():
        model(input_ids=torch.tensor([doc]))
    handle.remove()
    tie, apart = (bias[0][i] - bias[0][j]).abs().max(), (bias[0][i] - bias[0][i + 1 if i + 1 != j else i - 1]).abs()
    assert float(tie) <= 1e-6 < float(apart.max()), (i, j, tie, apart)  # a repeated token's keys tie
    packed, padded = _packed_and_padded(model, distinct)
    assert float((packed - padded).abs().max()) < 1e-5
