"""Qwen4-Exp's query-sparse attention under SP (``hf_sp_trainer/attention/qsa.py``), in process: the selection against
the installed indexer over packed rows and in tiles, the behaviour checks of the swapped classes with negative
controls, a ring accepted, and that the budget acts in the family suite's tiny model. Over gloo ranks: the
family suite (``test_model_families.py``: exact at sp 2 and 4)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen4_exp import modeling_qwen4_exp as qwen4

from hf_sp_trainer.attention import block_sparse, qsa
from hf_sp_trainer.attention.qsa import qsa_projection, sp_qsa_select
from hf_sp_trainer.mixers.qsa_checks import _parts, _visible, qsa_attention_ok, qsa_indexer_ok
from hf_sp_trainer.validate import validate_model_for_sp
from tests.harness import EXACT, row_anchored

pytestmark = pytest.mark.unit  # in-process

ATTENTION, INDEXER = qwen4.Qwen4ExpTextAttention, qwen4.Qwen4ExpTextQSAIndexer


def _select(layer, rotary, hidden, segments, monkeypatch=None, score_bytes=None):
    """``sp_qsa_select`` (no group) over rows of packed documents ``segments``: the visible selected keys."""
    from hf_sp_trainer.documents import document_bounds

    seq = hidden.shape[1]
    positions = torch.stack([torch.cat([torch.arange(e - s) for s, e in row]) for row in segments])
    bounds = document_bounds(segments, seq)
    embeddings = rotary(hidden, positions)
    if score_bytes is not None:
        monkeypatch.setattr(qsa, "SCORE_BYTES", score_bytes)
    picks = sp_qsa_select(layer.indexer, qsa_projection(layer.indexer, hidden, embeddings), embeddings, bounds, None, 0)
    flat = picks + torch.arange(picks.shape[0])[:, None, None] * seq  # rows laid end to end, as the bounds
    return _visible(flat.view(1, -1, picks.shape[-1]).contiguous(), bounds)


def test_checks_pass_and_catch_what_they_guard(monkeypatch):
    """The installed classes pass; the selection with the blocks' RoPE at their last token, or its blocks counted from
    the row's first token instead of the document's, fails the indexer check; an attention that drops the
    ``indices`` it is given fails the attention check."""
    assert qsa_indexer_ok.__wrapped__(INDEXER, INDEXER.forward)
    assert qsa_attention_ok.__wrapped__(ATTENTION, ATTENTION.forward)
    original = qsa.pooled_blocks

    def rope_at_block_end(indexer, keys, cos, sin, bounds):
        late = -(indexer.compress_ratio - 1)
        return original(indexer, keys, cos.roll(late, 1), sin.roll(late, 1), bounds)

    with monkeypatch.context() as m:
        m.setattr(qsa, "pooled_blocks", rope_at_block_end)
        assert not qsa_indexer_ok.__wrapped__(INDEXER, INDEXER.forward)
    with monkeypatch.context() as m:
        m.setattr(block_sparse, "document_positions", row_anchored)
        assert not qsa_indexer_ok.__wrapped__(INDEXER, INDEXER.forward)

    def drops_indices(self, **kwargs):
        kwargs.pop("indices", None)
        return ATTENTION.forward(self, **kwargs)

    assert not qsa_attention_ok.__wrapped__(ATTENTION, drops_indices)


def test_selection_over_rows_and_in_tiles_matches_each_document_alone(monkeypatch):
    """Two rows of packed documents (one starting mid-block, one shorter than a block) select, per query, the tokens
    the installed indexer selects on each document alone; query tiles of 2 select the same."""
    layer, rotary = _parts(INDEXER)
    hidden = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(3))
    segments = [[(0, 11), (11, 24)], [(0, 2), (2, 24)]]
    expected = torch.zeros(1, 48, 48, dtype=torch.bool)
    with torch.no_grad():
        for row, docs in enumerate(segments):
            for s, e in docs:
                n, at = e - s, row * 24 + s
                embeddings = rotary(hidden[row : row + 1, s:e], torch.arange(n)[None])
                causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
                alone = INDEXER.forward(layer.indexer, hidden[row : row + 1, s:e], embeddings, causal, None)
                expected[0, at : at + n, at : at + n] = alone[0, 0]
        whole = _select(layer, rotary, hidden, segments)
        tiled = _select(layer, rotary, hidden, segments, monkeypatch, score_bytes=4 * 2 * 8 * 12 * 2)
    assert torch.equal(whole, expected) and torch.equal(tiled, expected)
    assert (whole.sum(-1) < torch.ones(48, 48).tril().sum(-1)).any()  # the budget binds somewhere


def test_the_budget_matters_in_the_family_model_and_a_ring_is_accepted():
    """The family suite's tiny Qwen4-Exp (top-2 blocks of 4 tokens) has a sparse layer whose budget binds under its
    rows: every token selected instead moves its loss far beyond the tolerance. A ring is accepted (DSA's all-gather
    path; exact in the family suite's ring sample and the VLM matrix)."""
    from tests.family_harness import build_model

    model = build_model("qwen4_exp_text", "Qwen4ExpForCausalLM")
    assert validate_model_for_sp(model, 4) == (4, 1)
    assert validate_model_for_sp(model, 4, ring_size=2) == (2, 2)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sparse = model(input_ids=ids, labels=ids).loss.item()
        indexers = [m for m in model.modules() if isinstance(m, INDEXER)]
        for indexer in indexers:
            indexer.token_budget, indexer.block_topk = 1000, 1000 // indexer.compress_ratio  # > the row
        dense = model(input_ids=ids, labels=ids).loss.item()
    assert indexers and abs(dense / sparse - 1) > 10 * EXACT
