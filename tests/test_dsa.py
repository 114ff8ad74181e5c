"""DeepSeek sparse attention under SP (``hf_sp_trainer/attention/dsa.py``), in process: the tiled indexer, the
selected-keys attention (a ring rank's portion of it too), the behaviour checks of the swapped classes (with
negative controls). Over gloo ranks: the family suite (every DSA family, top-k crossed; a ring sample) and
``test_equivalence_attention.py``."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from transformers.models.axk2 import modeling_axk2 as axk2
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32
from transformers.models.dots3_note import modeling_dots3_note as dots3
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm
from transformers.models.hy_v4 import modeling_hy_v4 as hy_v4
from transformers.models.hy_v4_vl import modeling_hy_v4_vl as hy_v4_vl

from hf_sp_trainer.attention import dsa
from hf_sp_trainer.attention.dsa import PROJECTIONS, document_causal, document_ids, selected_attention, sp_index_topk
from hf_sp_trainer.documents import document_bounds
from hf_sp_trainer.mixers.checks import _dsa_attention_ok, _dsa_indexer_ok, _dsa_parts
from hf_sp_trainer.validate import validate_model_for_sp
from tests.harness import EXACT, tiny_model

pytestmark = pytest.mark.unit  # in-process


def _selected(picks: torch.Tensor, bounds: torch.Tensor, seq: int) -> torch.Tensor:
    """The visible keys ``picks`` selects, as a ``[b, seq, seq]`` mask."""
    b = picks.shape[0]
    chosen = torch.zeros(b, seq, seq, dtype=torch.bool).scatter_(-1, picks.long(), True)
    return chosen & document_causal(document_ids(bounds, b, seq, "cpu"), torch.arange(seq))


INDEXERS = [v32.DeepseekV32Indexer, glm.GlmMoeDsaIndexer, axk2.AXK2Indexer, dots3.Dots3NoteTextIndexer]
INDEXERS += [hy_v4.HYV4Indexer, hy_v4_vl.HYV4VLIndexer]


@pytest.mark.parametrize("keys_per_chunk", [0, 7], ids=["query_tiles", "streamed_keys"])
@pytest.mark.parametrize("cls", INDEXERS, ids=lambda c: c.__name__)
def test_tiled_index_topk_equals_one_tile(cls, keys_per_chunk, monkeypatch):
    """Query tiles of 3 (the score bytes bound) pick what one tile picks, over two rows of packed documents; and
    where one query's scores over the row exceed the bound, the keys streamed in chunks of 7, each merged into the
    running top-k, pick the same visible keys (``_streamed_topk``)."""
    indexer, rotary = _dsa_parts(cls)
    gen = torch.Generator().manual_seed(1)
    hidden, q_resid = torch.randn(2, 30, 32, generator=gen), torch.randn(2, 30, 16, generator=gen)
    segments = [[(0, 12), (12, 30)], [(0, 30)]]
    positions = torch.stack([torch.cat([torch.arange(e - s) for s, e in row]) for row in segments])
    bounds = document_bounds(segments, 30)
    projected = PROJECTIONS[cls.__name__](indexer, hidden, q_resid, rotary(hidden, positions))
    whole = _selected(sp_index_topk(indexer, projected, bounds, None, 0), bounds, 30)
    budget = 4 * indexer.n_heads * 2 * (keys_per_chunk or 30 * 3)
    monkeypatch.setattr(dsa, "SCORE_BYTES", budget)
    picks = sp_index_topk(indexer, projected, bounds, None, 0)
    assert picks.shape == (2, 30, indexer.index_topk) and int(picks.min()) >= 0 and int(picks.max()) < 30
    tiled = _selected(picks, bounds, 30)
    assert torch.equal(whole, tiled)
    assert int(whole.sum(-1).max()) == indexer.index_topk  # the top-k binds: late queries see more keys than k


def test_selected_attention_is_a_softmax_over_the_selected_visible_keys():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 12, 8, generator=gen), torch.randn(1, 2, 12, 8, generator=gen)
    v = torch.randn(1, 2, 12, 6, generator=gen)  # MLA: v head dim != q/k's
    indices = torch.randint(0, 12, (1, 12, 3), generator=gen)
    bounds = torch.tensor([0, 5, 12])
    indices[..., 0] = torch.arange(12)  # every query keeps itself (a row with no key would be undefined)
    keep = _selected(indices, bounds, 12)[:, None]
    logits = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~keep, float("-inf"))
    expected = (logits.softmax(-1) @ v).transpose(1, 2)
    assert torch.allclose(selected_attention(q, k, v, indices, bounds, 0.3), expected, atol=1e-6)


def test_selected_attention_with_sinks_adds_one_logit_per_head():
    """HY-V4's sinks: an extra logit per head in the denominator (what its eager attention computes)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=gen) for _ in range(3))
    indices, bounds, sinks = torch.arange(10).expand(1, 10, 10), torch.tensor([0, 4, 10]), torch.tensor([0.5, 2.0])
    keep = _selected(indices, bounds, 10)[:, None]
    logits = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~keep, float("-inf"))
    with_sink = torch.cat([logits, sinks.view(1, 2, 1, 1).expand(1, 2, 10, 1)], -1).softmax(-1)[..., :-1]
    expected = (with_sink @ v).transpose(1, 2)
    got = selected_attention(q, k, v, indices, bounds, 0.3, sinks=sinks)
    assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.allclose(selected_attention(q, k, v, indices, bounds, 0.3), expected, atol=1e-3)


@pytest.mark.parametrize("sinks", [None, torch.tensor([0.5, 2.0])], ids=["plain", "sinks"])
def test_selected_attention_tiles_match_one_tile_with_gradients(sinks, monkeypatch):
    """Query tiles of 3, each recomputed in the backward, give one tile's output and q / k / v gradients."""
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, 2, 10, 8, generator=gen) for _ in range(3)]
    indices = torch.randint(0, 10, (2, 10, 4), generator=gen)
    indices[..., 0] = torch.arange(10)
    bounds, probe = torch.tensor([0, 4, 10, 20]), torch.randn(2, 10, 2, 8, generator=gen)

    def run():
        q, k, v = (t.clone().requires_grad_() for t in leaves)
        out = selected_attention(q, k, v, indices, bounds, 0.3, sinks=sinks)
        (out * probe).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    whole = run()
    monkeypatch.setattr(dsa, "SCORE_BYTES", 4 * 2 * 2 * 10 * 3)
    for got, ref in zip(run(), whole, strict=True):
        assert torch.allclose(got, ref, atol=1e-6)


def test_checks_pass_and_catch_what_they_guard():
    """Negative controls: GLM-5's interleaved indexer RoPE computed as DeepSeek-V3.2's (non-interleaved) fails the
    indexer check; an attention that never hands its top-k to the registered kernel fails the attention check."""
    for indexer in INDEXERS:
        attention = getattr(sys.modules[indexer.__module__], indexer.__name__.replace("Indexer", "Attention"))
        assert _dsa_attention_ok.__wrapped__(attention, attention.forward), attention
        assert _dsa_indexer_ok.__wrapped__(indexer, indexer.forward), indexer
    original = PROJECTIONS["GlmMoeDsaIndexer"]
    PROJECTIONS["GlmMoeDsaIndexer"] = functools.partial(dsa.v32_projection, rope=v32.apply_rotary_pos_emb)
    try:
        assert not _dsa_indexer_ok.__wrapped__(glm.GlmMoeDsaIndexer, glm.GlmMoeDsaIndexer.forward)
    finally:
        PROJECTIONS["GlmMoeDsaIndexer"] = original

    def eager_only(self, **kwargs):  # a forward that attends through eager's mask, never the registered kernel
        key, self.config._attn_implementation = self.config._attn_implementation, "eager"
        try:
            return v32.DeepseekV32Attention.forward(self, **kwargs)
        finally:
            self.config._attn_implementation = key

    assert not _dsa_attention_ok.__wrapped__(v32.DeepseekV32Attention, eager_only)


def test_hy_v4_vl_indexer_check_catches_the_text_rope(monkeypatch):
    """HY-V4-VL's indexer rotates interleaved pairs (in fp32): its projection computed with a half-split RoPE
    (DeepSeek-V3.2's; HY-V4's own before transformers 5.25) fails its check."""
    indexer = hy_v4_vl.HYV4VLIndexer

    def half_split_rope(module, *args):
        with monkeypatch.context() as m:
            m.setattr(hy_v4_vl, dsa._rope_called(indexer), v32.apply_rotary_pos_emb)
            return dsa.hy_v4_projection(module, *args)

    monkeypatch.setitem(PROJECTIONS, indexer.__name__, half_split_rope)
    assert not _dsa_indexer_ok.__wrapped__(indexer, indexer.forward)


def test_the_top_k_matters_in_the_tiny_models():
    """The spine cases' DSA models pick fewer keys than their rows hold: all keys instead changes the loss; GLM-5's
    second layer reuses the first's top-k (no indexer of its own)."""

    def loss(model) -> float:
        ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
        return model(input_ids=ids, labels=ids).loss.item()

    for family in ("deepseek_v32", "glm_moe_dsa"):
        model = tiny_model(family)
        sparse = loss(model)
        model.config.index_topk = 10**6
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = 10**6
        assert abs(loss(model) / sparse - 1) > 10 * EXACT, family  # about 1e-3
    assert [layer.self_attn.indexer is None for layer in tiny_model("glm_moe_dsa").model.layers] == [False, True]


def test_a_ring_is_accepted():
    """DSA with a ring takes the all-gather path (``ring_gather``; exact in the family suite's ring sample, the VLM
    matrix and test_equivalence_attention.py); the other selecting attentions refuse one (their own tests)."""
    model = tiny_model("deepseek_v32")
    assert validate_model_for_sp(model, 4) == (4, 1)
    assert validate_model_for_sp(model, 4, ring_size=2) == (2, 2)
    assert validate_model_for_sp(model, 4, ring_size=4) == (1, 4)


@pytest.mark.parametrize("sinks", [None, torch.tensor([0.5, 2.0])], ids=["plain", "sinks"])
def test_selected_attention_of_a_ring_portion_is_those_rows_of_the_whole(sinks, monkeypatch):
    """A ring rank's zigzag portion of the queries (at their whole-sequence positions, against the whole sequence's
    K/V, as ``ring_gather`` gathers them) gets those rows of the whole output and its share of the gradients: the
    portions' q gradients are the whole one's rows, their k / v gradients sum to the whole one's; in tiles of 3."""
    from hf_sp_trainer.sharding import SequenceSharding

    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, 2, 16, 8, generator=gen) for _ in range(3)]
    indices = torch.randint(0, 16, (2, 16, 4), generator=gen)
    indices[..., 0] = torch.arange(16)
    bounds, probe = torch.tensor([0, 5, 16, 23, 32]), torch.randn(2, 16, 2, 8, generator=gen)
    monkeypatch.setattr(dsa, "SCORE_BYTES", 4 * 2 * 2 * 16 * 3)

    def run(queries):
        q, k, v = (t.clone().requires_grad_() for t in leaves)
        rows = slice(None) if queries is None else queries
        out = selected_attention(q[:, :, rows], k, v, indices, bounds, 0.3, sinks=sinks, queries=queries)
        (out * probe[:, rows]).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    whole = run(None)
    parts = [run(SequenceSharding(2, 2).positions(16, rank)) for rank in range(2)]
    assert SequenceSharding(2, 2).positions(16, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # zigzag: chunks 0, 3
    for rank, (out, dq, _, _) in enumerate(parts):
        rows = SequenceSharding(2, 2).positions(16, rank)
        assert torch.allclose(out, whole[0][:, rows], atol=1e-6)
        assert torch.allclose(dq[:, :, rows], whole[1][:, :, rows], atol=1e-6)
    for i in (2, 3):
        assert torch.allclose(parts[0][i] + parts[1][i], whole[i], atol=1e-6)


# -- Mistral-Large-4: an indexer of the hidden states, its queries scaled by their document positions ---------------
def test_mistral_large4_checks_pass_and_catch_what_they_guard(monkeypatch):
    """Its checks pass on the installed classes (a RoPE, a NoPE and a shared-top-k layer) and fail when what they
    guard breaks: the indexer's query scaling dropped, or given whole-row positions instead of each document's, or
    its interleaved RoPE computed as DeepSeek-V3.2's; an attention that never hands its top-k to the kernel."""
    from transformers.models.mistral_large4 import modeling_mistral_large4 as ml4

    from hf_sp_trainer.mixers.positional_dsa_checks import positional_attention_ok, positional_indexer_ok

    indexer, attention = ml4.MistralLarge4TextIndexer, ml4.MistralLarge4TextAttention
    assert positional_indexer_ok.__wrapped__(indexer, indexer.forward)
    assert positional_attention_ok.__wrapped__(attention, attention.forward)
    original = dsa.POSITIONAL_PROJECTIONS[indexer.__name__]

    def unscaled(module, hidden, embeddings, positions):
        module.softmax_scaling.forward = lambda q, *args, **kwargs: q  # the check's own module, built for it
        return original(module, hidden, embeddings, positions)

    def row_positions(module, hidden, embeddings, positions):
        return original(module, hidden, embeddings, torch.arange(hidden.shape[1])[None])

    def half_split_rope(module, hidden, embeddings, positions):
        with monkeypatch.context() as m:
            m.setattr(ml4, "apply_rotary_pos_emb_interleave", v32.apply_rotary_pos_emb)
            return original(module, hidden, embeddings, positions)

    for broken in (unscaled, row_positions, half_split_rope):
        monkeypatch.setitem(dsa.POSITIONAL_PROJECTIONS, indexer.__name__, broken)
        assert not positional_indexer_ok.__wrapped__(indexer, indexer.forward), broken.__name__
    monkeypatch.setitem(dsa.POSITIONAL_PROJECTIONS, indexer.__name__, original)

    def eager_only(self, **kwargs):  # attends through eager's mask, never the registered kernel
        key, self.config._attn_implementation = self.config._attn_implementation, "eager"
        try:
            return attention.forward(self, **kwargs)
        finally:
            self.config._attn_implementation = key

    assert not positional_attention_ok.__wrapped__(attention, eager_only)


def test_mistral_large4_takes_a_ring_and_its_top_k_acts():
    """The matrix's Mistral-Large-4 (tests/multimodal_families_extra.py) runs Ulysses and with a ring, and its
    decoder's top-5 changes its loss: every key selected instead moves it far beyond the tolerance."""
    from tests.multimodal_harness import build_vlm

    model = build_vlm("mistral_large4")
    assert validate_model_for_sp(model, 4) == (4, 1)
    assert validate_model_for_sp(model, 4, ring_size=2) == (2, 2)
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sparse = model(input_ids=ids, labels=ids).loss.item()
        for layer in model.model.language_model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = 10**6
        dense = model(input_ids=ids, labels=ids).loss.item()
    assert abs(dense / sparse - 1) > 10 * EXACT


KERNEL_CASES = {  # name: (kv heads, sinks, a ring portion of the queries, dtype)
    "plain": (2, False, False, torch.float32),
    "gqa_sinks": (1, True, False, torch.float32),
    "ring_portion": (2, True, True, torch.float32),
    "float64": (1, False, True, torch.float64),
}


@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_gathered_kernel_equals_the_dense_one_with_gradients(case, monkeypatch):
    """DSA's sparse kernel (``gathered_keys``: each query's picks gathered, ``O(n k)``) against the dense masked one
    (every key scored), in tiles of 1-2 queries: the same output and q / k / v / sinks gradients, with picks that
    are ``-1`` pads, repeated, in another document or in the query's future (all dropped), GQA, sinks and a ring
    rank's portion of the queries (``GATHER_ABOVE`` set for each kernel in turn)."""
    from hf_sp_trainer.attention import gathered_keys

    kv, with_sinks, portion, dtype = KERNEL_CASES[case]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 20, 8, generator=gen, dtype=dtype)
    k, v = torch.randn(2, kv, 20, 8, generator=gen, dtype=dtype), torch.randn(2, kv, 20, 6, generator=gen, dtype=dtype)
    indices = torch.randint(-1, 20, (2, 20, 6), generator=gen, dtype=torch.int32)
    indices[..., 0] = torch.arange(20)  # every query keeps itself
    indices[..., 1] = indices[..., 2]  # and repeats a pick
    bounds, sinks = torch.tensor([0, 7, 20, 31, 40]), torch.tensor([0.5, 2.0, -1.0, 0.0], dtype=dtype)
    queries = torch.tensor([0, 1, 2, 3, 16, 17, 18, 19]) if portion else None
    probe = torch.randn(2, 20, 4, 6, generator=gen, dtype=dtype)[:, queries if portion else slice(None)]

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        mine = leaves[0][:, :, queries] if portion else leaves[0]
        out = selected_attention(mine, *leaves[1:3], indices, bounds, 0.3, sinks=leaves[3] if with_sinks else None,
                                 queries=queries)  # fmt: skip
        (out * probe).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    calls = []
    monkeypatch.setattr(dsa, "attend_gathered_tile", lambda *a, **kw: calls.append(1) or attend(*a, **kw))
    attend = gathered_keys.attend_gathered_tile
    monkeypatch.setattr(gathered_keys, "GATHER_ABOVE", 0)
    monkeypatch.setattr(dsa, "SCORE_BYTES", 2 * (6 * kv * 14 * dtype.itemsize + 6 * 3 * 4 * 4) * 2)  # 2 queries
    gathered = run()
    assert len(calls) >= (8 if portion else 20) // 2  # tiles of at most 2 queries, gathered
    monkeypatch.setattr(gathered_keys, "GATHER_ABOVE", float("inf"))  # the dense kernel
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for got, ref in zip(gathered, run(), strict=True):
        assert (got is None) == (ref is None)
        if ref is not None:
            assert torch.allclose(got, ref, atol=tol, rtol=tol), (got - ref).abs().max()


def test_gather_threshold_from_the_environment(monkeypatch):
    """``HF_SP_DSA_GATHER_ABOVE`` overrides ``GATHER_ABOVE`` (a GPU's own crossover; the Trainer-level case sets 0);
    a value that is not a number is refused by name."""
    from hf_sp_trainer.attention.gathered_keys import GATHER_ABOVE_ENV, gathers

    assert not gathers(6, 100) and gathers(6, 480)
    monkeypatch.setenv(GATHER_ABOVE_ENV, "0")
    assert gathers(6, 100)
    monkeypatch.setenv(GATHER_ABOVE_ENV, "eighty")
    with pytest.raises(ValueError, match="HF_SP_DSA_GATHER_ABOVE='eighty' is not a number"):
        gathers(6, 100)


def test_gathered_kernel_in_bf16_is_as_close_as_the_dense_one(monkeypatch):
    """In bf16 the gathered kernel widens its logits' operands to fp32 (as the fused kernels keep fp32 scores): with
    sharp logits (~60, where bf16's spacing is 0.25-0.5) its output and gradients are about as close to a float64 run
    as the dense kernel's (SDPA's) bf16 ones (0.97x here), and closer than the same kernel with bf16 logits (the
    negative control: 1.13x the dense one's here). The bars leave room for other hosts' bf16 kernels: within 10% of
    SDPA's error, and below the control's on the same host (the one difference being the logits' dtype)."""
    from hf_sp_trainer.attention import gathered_keys
    from tests.exactness import capped_below_amx

    gen = torch.Generator().manual_seed(5)
    leaves = [torch.randn(1, 4, 64, 16, generator=gen) * scale for scale in (8, 8, 1)]  # q, k: logits ~ 60
    indices = torch.randint(0, 64, (1, 64, 8), generator=gen)
    indices[..., 0] = torch.arange(64)
    bounds, probe = torch.tensor([0, 30, 64]), torch.randn(1, 64, 4, 16, generator=gen, dtype=torch.float64)

    def run(dtype, gather):
        monkeypatch.setattr(gathered_keys, "GATHER_ABOVE", 0 if gather else float("inf"))
        q, k, v = (t.to(dtype).requires_grad_() for t in leaves)
        out = selected_attention(q, k, v, indices, bounds, 0.25)
        (out.double() * probe).sum().backward()
        return [out.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]

    def error(got: list[torch.Tensor]) -> float:
        return max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, reference, strict=True))

    reference = run(torch.float64, False)
    if capped_below_amx():
        pytest.skip(capped_below_amx())
    errors = {gather: error(run(torch.bfloat16, gather)) for gather in (False, True)}
    monkeypatch.setattr(gathered_keys, "LOGITS_AT_LEAST", torch.bfloat16)
    errors["bf16 logits"] = error(run(torch.bfloat16, True))
    assert errors[True] <= 1.1 * errors[False] and errors[True] < 0.95 * errors["bf16 logits"], errors


DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2", "dots3_note_text")  # Mistral-Large-4: a VLM decoder


def _families_with_gathered_keys(names: list[tuple[str, str]], sp_size: int, ring: int) -> dict:
    """``family_harness.run_families`` (top-k crossed) with every DSA selection on the gathered kernel and a score
    budget of 1 KiB (the indexer streams its keys, ``_streamed_topk``; the attention tiles hold a query or two), and
    how many tiles the gathered kernel attended and how many queries streamed their keys on this rank."""
    from hf_sp_trainer.attention import gathered_keys
    from tests.family_harness import run_families

    calls, attend, streamed, stream = [], dsa.attend_gathered_tile, [], dsa._streamed_topk
    above, budget = gathered_keys.GATHER_ABOVE, dsa.SCORE_BYTES
    dsa.attend_gathered_tile = lambda *args, **kwargs: calls.append(1) or attend(*args, **kwargs)
    dsa._streamed_topk = lambda *args, **kwargs: streamed.append(1) or stream(*args, **kwargs)
    gathered_keys.GATHER_ABOVE, dsa.SCORE_BYTES = 0, 1024
    try:
        outcomes = run_families(names, sp_size, ring, True)
    finally:  # the pool's rank serves later cases (and its reset restores them too: tests/pool.py)
        dsa.attend_gathered_tile, dsa._streamed_topk = attend, stream
        gathered_keys.GATHER_ABOVE, dsa.SCORE_BYTES = above, budget
    return {**outcomes, "gathered_tiles": len(calls), "streamed_queries": len(streamed)}


@pytest.mark.dist
def test_dsa_families_are_exact_on_the_gathered_kernel_and_streamed_keys():
    """Every DSA family, its top-k crossed under its documents, on the gathered (sparse) kernel instead of the dense
    one (the tiny rows are far below ``GATHER_ABOVE``) and with the indexer streaming its keys (the rows are far
    below ``SCORE_BYTES`` too): each document alone vs SP on a ring of 2 (sp 2), so the ring ranks' zigzag portions
    of the queries take them too. HY-V4 is judged with its float64 run (``family_harness.NEAR_THE_BAR``)."""
    from tests.family_harness import families
    from tests.harness import run_distributed

    names = [(f.model_type, f.class_name) for f in families() if f.model_type in DSA_FAMILIES]
    assert {name for name, _ in names} == set(DSA_FAMILIES)
    results = run_distributed(2, _families_with_gathered_keys, names, 2, 2, timeout=900)
    payload = results[0][1] if isinstance(results[0], tuple) else results[0]
    assert payload["gathered_tiles"] > 0 and payload["streamed_queries"] > 0
    for variant in ("default", "crossed"):
        for model_type in DSA_FAMILIES:
            outcome = payload[variant][model_type]
            assert outcome["status"] == "exact", (variant, model_type, outcome["detail"])


def test_pooled_checks_pass_and_catch_what_they_guard(monkeypatch):
    """GLM-5-Next's checks pass on the installed classes, and fail for pools counted from the row's start (what
    transformers does on a packed row), for a selection without the query's own pool's tail, and for an attention
    that does not return its top-k to the layer reusing it."""
    from transformers.models.glm5_next import modeling_glm5_next as g5

    from hf_sp_trainer.attention import pooled_dsa
    from hf_sp_trainer.mixers import pooled_dsa_checks as checks

    indexer, attention = g5.Glm5NextTextIndexer, g5.Glm5NextTextAttention
    indexer_ok, attention_ok = checks.pooled_indexer_ok.__wrapped__, checks.pooled_attention_ok.__wrapped__
    assert indexer_ok(indexer, indexer.forward) and attention_ok(attention, attention.forward)
    pools = pooled_dsa.document_pools
    with monkeypatch.context() as m:
        m.setattr(pooled_dsa, "document_pools", lambda starts, ends, size, device: pools([0], ends[-1:], size, device))
        assert not indexer_ok(indexer, indexer.forward)
    topk = checks.sp_pooled_topk

    def no_tail(indexer, *args):
        out = topk(indexer, *args)
        out[..., indexer.index_topk :] = -1
        return out

    with monkeypatch.context() as m:
        m.setattr(checks, "sp_pooled_topk", no_tail)
        assert not indexer_ok(indexer, indexer.forward)
    forward = checks.glm5_next_attention_forward
    with monkeypatch.context() as m:
        m.setattr(checks, "glm5_next_attention_forward", lambda *a, **k: (*forward(*a, **k)[:2], None))
        assert not attention_ok(attention, attention.forward)


def test_every_selecting_attention_takes_a_ring_or_splits_no_heads():
    """Each selecting attention either takes a ring (its selection over zigzag shards: every selection function takes
    the ``sharding``; its K/V by ``ring_gather``) or splits no heads (DeepSeek-V4: contiguous shards, any sp)."""
    import inspect

    from hf_sp_trainer.attention.block_sparse import sp_block_topk
    from hf_sp_trainer.attention.pooled_dsa import sp_pooled_topk
    from hf_sp_trainer.attention.qsa import sp_qsa_select
    from hf_sp_trainer.model import mixers

    assert set(mixers.SELECTING_ATTENTIONS) == {*mixers.RING_SELECTING, *mixers.CONTEXT_PARALLEL_ATTENTIONS}
    assert not set(mixers.RING_SELECTING) & set(mixers.CONTEXT_PARALLEL_ATTENTIONS)
    for select in (sp_index_topk, sp_pooled_topk, sp_qsa_select, sp_block_topk):
        assert inspect.signature(select).parameters["sharding"].default is None, select.__name__
