"""Qwen4-Exp's per-layer embeddings under SP (``hf_sp_trainer/mixers/token_history.py``), in process: the behaviour
checks of the swapped parts with negative controls, and the dilated conv as a causal conv. Over gloo ranks: the family
suite (its tiny config has PLE layers: exact at sp 2 and 4) and the spine's Qwen4-Exp cases."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen4_exp import modeling_qwen4_exp as qwen4

from hf_sp_trainer.mixers import ple_checks, token_history
from hf_sp_trainer.mixers.ple_checks import ngram_ok, ple_conv_ok

pytestmark = pytest.mark.unit  # in-process

NGRAM, PLE = qwen4.Qwen4ExpTextNGramEmbedding, qwen4.Qwen4ExpTextPLELayer


def test_checks_pass_and_catch_what_they_guard(monkeypatch):
    """The installed parts pass; pieces run without their document's earlier ids, or a dilated weight laid out as
    if undilated, fail."""
    assert ngram_ok.__wrapped__(NGRAM, NGRAM.forward)
    assert ple_conv_ok.__wrapped__(PLE, PLE._short_conv)

    def without_history(embed, module, whole, runs):  # each piece as if its document started there
        with monkeypatch.context() as m:
            m.setattr(module, "context_len", 0)
            return token_history.document_ngrams(embed, module, whole, runs)

    with monkeypatch.context() as m:
        m.setattr(ple_checks, "document_ngrams", without_history)
        assert not ngram_ok.__wrapped__(NGRAM, NGRAM.forward)

    def undilated(weight, dilation):
        dense = weight.new_zeros(weight.shape[0], (weight.shape[-1] - 1) * dilation + 1)
        dense[:, -weight.shape[-1] :] = weight[:, 0]
        return dense

    with monkeypatch.context() as m:
        m.setattr(token_history, "dilated_as_causal", undilated)
        assert not ple_conv_ok.__wrapped__(PLE, PLE._short_conv)


def test_dilated_weight_matches_torch_conv():
    """``dilated_as_causal``: torch's dilated depthwise conv, zero-padded in front, is the causal conv of the spread
    weight (``F.conv1d`` of the dense weight, every tap, the same padding)."""
    conv = torch.nn.Conv1d(3, 3, kernel_size=3, groups=3, dilation=4, bias=False)
    x = torch.randn(1, 3, 20)
    dense = token_history.dilated_as_causal(conv.weight, 4)
    expected = conv(torch.nn.functional.pad(x, (8, 0)))
    got = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (8, 0)), dense[:, None], groups=3)
    assert dense.shape == (3, 9) and torch.allclose(got, expected, atol=1e-6)


@pytest.mark.dist
def test_qwen4_exp_is_exact_at_sp4():
    """The family suite's Qwen4-Exp (PLE layers, query-sparse attention, Gated DeltaNet) at sp 4 as Ulysses 4 (the
    suite runs sp 2 and Ulysses 2 x ring 2): its fp32 gap sits near the bar (8e-6 to 2e-5 by host), so it is judged
    with its float64 run (``tests/exactness.py``, ``family_harness.NEAR_THE_BAR``)."""
    from tests.family_harness import run_families
    from tests.harness import run_distributed, unwrap_results

    names = [("qwen4_exp_text", "Qwen4ExpForCausalLM")]
    outcome = unwrap_results(run_distributed(4, run_families, names, 4, None))[0]["default"]["qwen4_exp_text"]
    assert outcome["status"] == "exact" and outcome["float64"] is not None, outcome
