"""MiniMax-M3's block-sparse attention under SP (``hf_sp_trainer/attention/block_sparse.py``), in process: the tiled
block top-k against one tile, the attention against a dense masked softmax, the behaviour check with its negative
controls, the crossed settings acting, and a ring accepted. Exactness on 2 and 4 ranks: the family suite
(``tests/test_model_families.py``, ``minimax_m3_vl_text`` with ``index_topk_blocks`` 2 of blocks of 4 crossed) and
``tests/test_equivalence_attention.py``."""

from __future__ import annotations

import pytest
import torch
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

from hf_sp_trainer.attention import block_sparse, dsa
from hf_sp_trainer.attention.block_sparse import (
    block_keep,
    block_selected_attention,
    document_positions,
    m3_projection,
    sp_block_topk,
)
from hf_sp_trainer.attention.dsa import document_causal
from hf_sp_trainer.mixers.block_checks import _parts, block_sparse_ok
from hf_sp_trainer.validate import validate_model_for_sp
from tests.family_harness import build_model
from tests.harness import EXACT

pytestmark = pytest.mark.unit  # in-process

BOUNDS = torch.tensor([0, 10, 23, 31])  # three documents, one starting inside a block of 3


def _picked(seed: int = 0):
    layer, rotary = _parts(m3.MiniMaxM3VLIndexer)
    hidden = torch.randn(1, 31, 32, generator=torch.Generator().manual_seed(seed))
    _, positions = document_positions(BOUNDS, 1, 31, "cpu")
    projected = m3_projection(layer.indexer, hidden, rotary(hidden, positions))
    return layer, projected


def test_tiled_block_topk_equals_one_tile(monkeypatch) -> None:
    layer, projected = _picked()
    whole = sp_block_topk(layer.indexer, projected, BOUNDS, None, 0)
    monkeypatch.setattr(block_sparse, "SCORE_BYTES", 4 * 2 * 31 * 3)  # tiles of 3 queries
    assert torch.equal(sp_block_topk(layer.indexer, projected, BOUNDS, None, 0), whole)
    assert whole.shape == (1, 2, 31, 2) and whole.dtype == torch.int32
    assert bool((whole[:, :, 0] == torch.tensor([0, -1], dtype=torch.int32)).all())  # a first token: its own block


def test_block_attention_is_a_softmax_over_the_selected_blocks() -> None:
    """Each query head attends to its KV group's selected blocks, causally, within its document; heads of one rank
    (``first``) read their own groups' selections."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 31, 8, generator=gen) for _ in range(3))
    selection = torch.randint(-1, 4, (1, 2, 31, 2), generator=gen, dtype=torch.int32)
    selection[..., 0] = document_positions(BOUNDS, 1, 31, "cpu")[1] // 3  # the own block: a visible key each
    docs, positions = document_positions(BOUNDS, 1, 31, "cpu")
    keep = block_keep(selection, positions // 3, 5) & document_causal(docs, torch.arange(31))[:, None]
    logits = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep.repeat_interleave(2, dim=1), float("-inf"))
    expected = (logits.softmax(-1) @ v).transpose(1, 2)
    got = block_selected_attention(q, k, v, selection, 3, 4, 0, BOUNDS, 0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    upper = block_selected_attention(q[:, 2:], k[:, 2:], v[:, 2:], selection, 3, 4, 2, BOUNDS, 0.5)
    torch.testing.assert_close(upper, expected[:, :, 2:], rtol=1e-5, atol=1e-6)


def test_block_attention_tiles_match_one_tile_with_gradients(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 31, 8, generator=gen, requires_grad=True) for _ in range(3))
    layer, projected = _picked()
    selection = sp_block_topk(layer.indexer, projected, BOUNDS, None, 0)

    def run():
        out = block_selected_attention(q, k, v, selection, 3, 4, 0, BOUNDS, 0.5)
        return [out, *torch.autograd.grad(out.square().sum(), (q, k, v))]

    whole = run()
    monkeypatch.setattr(dsa, "SCORE_BYTES", 4 * 4 * 31 * 5)  # tiles of 5 queries, each recomputed in the backward
    for got, ref in zip(run(), whole, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_check_passes_and_catches_what_it_guards() -> None:
    """Negative controls: an indexer anchoring its blocks at slots of the packed row, or one keeping one block fewer,
    fails the indexer half; an attention that never hands its selection to the registered kernel fails the other."""
    assert block_sparse_ok.__wrapped__(m3.MiniMaxM3VLIndexer, m3.MiniMaxM3VLIndexer.forward)

    def fewer(self, hidden_states, position_embeddings, cache, position_ids):
        return m3.MiniMaxM3VLIndexer.forward(self, hidden_states, position_embeddings, cache, position_ids)[..., :-1]

    def shifted(self, hidden_states, position_embeddings, cache, position_ids):  # blocks one slot off the start
        return m3.MiniMaxM3VLIndexer.forward(self, hidden_states, position_embeddings, cache, position_ids + 1)

    assert not block_sparse_ok.__wrapped__(m3.MiniMaxM3VLIndexer, fewer)
    assert not block_sparse_ok.__wrapped__(m3.MiniMaxM3VLIndexer, shifted)
    original = m3.MiniMaxM3VLAttention.forward

    def eager_only(self, **kwargs):  # attends through eager's block mask, never the registered kernel
        key, self.config._attn_implementation = self.config._attn_implementation, "eager"
        try:
            return original(self, **kwargs)
        finally:
            self.config._attn_implementation = key

    m3.MiniMaxM3VLAttention.forward = eager_only
    try:
        assert not block_sparse_ok.__wrapped__(m3.MiniMaxM3VLIndexer, m3.MiniMaxM3VLIndexer.forward)
    finally:
        m3.MiniMaxM3VLAttention.forward = original


def test_the_block_selection_matters_in_the_tiny_model() -> None:
    def loss(model) -> float:
        ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
        return model(input_ids=ids, labels=ids).loss.item()

    model = build_model("minimax_m3_vl_text", "MiniMaxM3VLForCausalLM")
    indexers = [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]
    assert indexers
    for indexer in indexers:
        indexer.block_size, indexer.topk_blocks = 4, 2
    sparse = loss(model)
    for indexer in indexers:
        indexer.topk_blocks = 10**6
    assert abs(loss(model) / sparse - 1) > 10 * EXACT


def test_a_ring_is_accepted() -> None:
    """With a ring its selections run over the zigzag shards and its K/V are gathered (``dsa.ring_gather``): exact in
    the family suite's ring sample, the VLM matrix and test_equivalence_attention.py."""
    model = build_model("minimax_m3_vl_text", "MiniMaxM3VLForCausalLM")
    assert validate_model_for_sp(model, 2) == (2, 1)
    assert validate_model_for_sp(model, 4, ring_size=2) == (2, 2)
