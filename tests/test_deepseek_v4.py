"""DeepSeek-V4's attention under SP (``hf_sp_trainer/attention/deepseek_v4.py``), in process: the behaviour check of
the swapped forward with negative controls, that its compression and top-k act in the family suite's tiny model, the
refusal of a ring. Over gloo ranks: sp 4 crossed (the family suite runs sp 2), judged by ``tests/exactness.py`` with
its float64 run (``family_harness.NEAR_THE_BAR``: its fp32 gap is of the order of fp32 round-off)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from hf_sp_trainer.attention import block_sparse, deepseek_v4
from hf_sp_trainer.mixers.v4_checks import v4_attention_ok
from hf_sp_trainer.validate import validate_model_for_sp
from tests.harness import EXACT, row_anchored

pytestmark = pytest.mark.unit  # in-process

ATTENTION = v4.DeepseekV4Attention


def test_check_passes_and_catches_what_it_guards(monkeypatch):
    """The installed forward passes; windows counted from the row's first token instead of the document's, CSA
    entries without the previous window's half, the indexer's picks ignored, or the sinks dropped, each fail."""
    assert v4_attention_ok.__wrapped__(ATTENTION, ATTENTION.forward)

    select = deepseek_v4._csa_picks

    def no_overlap(at, rate):  # every window as if its document's first: no previous half
        return torch.zeros_like(at, dtype=torch.bool)

    def every_visible(attn, *args):  # the indexer's top-k out of reach: every complete entry before the query
        indexer = attn.compressor.indexer
        with monkeypatch.context() as m:
            m.setattr(indexer, "index_topk", 10**6)
            return select(attn, *args)

    def no_sinks(logits, sinks):
        return logits.softmax(dim=-1)

    for module, name, broken in [
        (block_sparse, "document_positions", row_anchored),
        (deepseek_v4, "_has_previous", no_overlap),
    ]:
        with monkeypatch.context() as m:
            m.setattr(module, name, broken)
            assert not v4_attention_ok.__wrapped__(ATTENTION, ATTENTION.forward), name
    with monkeypatch.context() as m:
        m.setattr(deepseek_v4, "_csa_picks", every_visible)
        assert not v4_attention_ok.__wrapped__(ATTENTION, ATTENTION.forward)
    with monkeypatch.context() as m:
        m.setattr(deepseek_v4, "_softmax_with_sinks", no_sinks)
        assert not v4_attention_ok.__wrapped__(ATTENTION, ATTENTION.forward)


def test_query_tiles_match_one_tile_with_gradients(monkeypatch):
    """Tiles of 1 to 3 queries (each recomputed in the backward, indexer scores and attention alike) give one tile's
    output and every parameter's gradient, for a sliding, a CSA and an HCA layer."""
    from hf_sp_trainer.mixers.v4_checks import _DOCS, _embeddings, _model

    model = _model(ATTENTION)
    hidden = torch.randn(1, 29, 32, generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(e - s) for s, e in _DOCS])[None]
    bounds, probe = torch.tensor([0, 11, 29]), torch.randn(1, 29, 32, generator=torch.Generator().manual_seed(3))

    def run():
        model.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        outs = [deepseek_v4.v4_attention_forward(layer.self_attn, x, _embeddings(model, x, positions), positions,
                                                 bounds, None, 0) for layer in model.layers]  # fmt: skip
        sum((o * probe).sum() for o in outs).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return [torch.cat([o.detach() for o in outs]), x.grad, *grads]

    whole = run()
    monkeypatch.setattr(deepseek_v4, "SCORE_BYTES", 4 * 4 * 40)
    for got, ref in zip(run(), whole, strict=True):
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_its_compression_and_top_k_act_and_any_sp_splits_no_heads():
    """The family suite's tiny DeepSeek-V4 (window 7, CSA every 2 tokens with the top 4, HCA every 8, crossed):
    every compressed entry picked, or no HCA window ever closed, moves its loss far beyond the tolerance. Its
    attention splits no heads, so any sp runs on contiguous shards (3 with its 4 heads); a ring is refused before any
    collective."""
    from tests.family_harness import build_model, float64_scope

    model = build_model("deepseek_v4", "DeepseekV4ForCausalLM", crossed=True)
    assert model.config.num_attention_heads % 3
    assert validate_model_for_sp(model, 4) == (4, 1) and validate_model_for_sp(model, 3) == (3, 1)
    with pytest.raises(
        ValueError, match="DeepseekV4Attention splits no heads.*any sp_size and no ring.*sp_ring_size=1"
    ):
        validate_model_for_sp(model, 4, ring_size=2)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def loss() -> float:
        with torch.no_grad(), float64_scope(model):
            return model(input_ids=ids, labels=ids).loss.item()

    base = loss()
    attentions = [layer.self_attn for layer in model.model.layers]
    indexers = [a.compressor.indexer for a in attentions if a.layer_type == "compressed_sparse_attention"]
    hca = [a.compressor for a in attentions if a.layer_type == "heavily_compressed_attention"]
    assert indexers and hca
    for indexer in indexers:
        indexer.index_topk = 10**6
    every = loss()
    for indexer in indexers:
        indexer.index_topk = 4
    for compressor in hca:
        compressor.compress_rate = 10**3
    unclosed = loss()
    assert abs(every / base - 1) > 10 * EXACT and abs(unclosed / base - 1) > 10 * EXACT, (base, every, unclosed)


@pytest.mark.dist
def test_sp4_crossed_with_a_shard_holding_no_compressed_window():
    """The family suite's DeepSeek-V4 with its settings crossed (its compressor rope longrope) at sp 4: a shard of the
    packed row where no compression window ends calls the compressor's rotary with no positions, and the SP group's
    longest-position all-reduce must still run there (it crashed on that rank and left the others waiting in the
    all-reduce until the collective timeout). Exact, its float64 run included (``family_harness.NEAR_THE_BAR``)."""
    from tests.family_harness import run_families
    from tests.harness import run_distributed

    results = run_distributed(4, run_families, [("deepseek_v4", "DeepseekV4ForCausalLM")], 4, None, True, timeout=600)
    payload = results[0][1] if isinstance(results[0], tuple) else results[0]
    for variant in ("default", "crossed"):
        outcome = payload[variant]["deepseek_v4"]
        assert outcome["status"] == "exact" and outcome["float64"] is not None, outcome


def _halo_run(sp_size: int) -> dict:
    """Each layer of the check's small V4 (window 5, CSA every 2, HCA every 4) on 32 tokens of three documents: this
    rank's shard under SP against one process on the whole sequence (output and the hidden states' gradient), and the
    token counts every all-gather of the layer moved."""
    import torch.distributed as dist

    from hf_sp_trainer.mixers.v4_checks import _embeddings, _model

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    model, seq = _model(ATTENTION), 32
    docs = ((0, 3), (3, 21), (21, 32))  # one across the shard boundary at sp 2 and 4, one ending just past a shard
    hidden = torch.randn(1, seq, 32, generator=torch.Generator().manual_seed(4))
    probe = torch.randn(1, seq, 32, generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(e - s) for s, e in docs])[None]
    bounds, s = torch.tensor([0, *(e for _, e in docs)]), seq // sp_size
    mine = slice(rank * s, (rank + 1) * s)
    sizes, real = [], deepseek_v4.all_gather_stack

    def recorded(x, grp):
        sizes.append(x.shape[1] if x.ndim > 2 else x.shape[0])  # tokens (a halo) or entries
        return real(x, grp)

    out = {"errors": [], "gathered": []}
    for layer in model.layers:
        results = []
        for whole in (True, False):
            x = hidden.clone().requires_grad_() if whole else hidden[:, mine].clone().requires_grad_()
            pos = positions if whole else positions[:, mine]
            deepseek_v4.all_gather_stack = real if whole else recorded
            try:
                args = (bounds, None, 0) if whole else (bounds, group, rank)
                y = deepseek_v4.v4_attention_forward(layer.self_attn, x, _embeddings(model, x, pos), pos, *args)
            finally:
                deepseek_v4.all_gather_stack = real
            (y * (probe if whole else probe[:, mine])).sum().backward()
            results.append((y.detach(), x.grad))
        (y1, g1), (ys, gs) = results
        grad = gs.clone()  # this rank's own tokens' gradient: the halos' parts came back through the gathers
        out["errors"].append(max(float((ys - y1[:, mine]).abs().max()), float((grad - g1[:, mine]).abs().max())))
        out["gathered"].append(list(sizes))
        sizes.clear()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("sp_size", [2, 4])
def test_windows_and_entries_need_only_a_left_halo(sp_size):
    """Under SP the layer gathers no whole-sequence tokens: the K = V window's halo (``window - 1`` = 4 tokens of
    each rank), the compressors' halos (CSA: ``2 rate - 1`` = 3, HCA: ``rate - 1`` = 3) and the entries (at most
    ``s / rate`` per rank); its output and the gradient of its input equal one process on the whole sequence."""
    from tests.harness import run_distributed, unwrap_results

    for result in unwrap_results(run_distributed(sp_size, _halo_run, sp_size)):
        assert max(result["errors"]) < 1e-5, result["errors"]
        s = 32 // sp_size
        sliding, csa, hca = result["gathered"]
        assert sliding == [min(s, 4)], sliding
        # CSA: K = V, its compressor's inputs (kv, gate) and entries, its indexer's inputs and entries
        assert csa[:3] == [min(s, 4), 3, 3] and csa[4:6] == [3, 3] and max(csa[3], csa[6]) <= s // 2, csa
        assert hca[:3] == [min(s, 4), 3, 3] and 0 < hca[3] <= s // 4, hca
