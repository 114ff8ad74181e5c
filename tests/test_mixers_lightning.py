"""MiniMax's lightning attention under SP (``hf_sp_trainer/mixers/lightning.py``): the layouts its kernel-level
cases run (in ``tests/test_mixers.py``'s spawned groups, against the installed layer's forward on each document
alone), and, in process, the swap's check of the installed forward and the swapped forward outside SP. The MiniMax
family: ``tests/test_model_families.py``; trainer level: ``tests/test_equivalence_hybrid.py``."""

from __future__ import annotations

import pytest
import torch

from hf_sp_trainer.documents import BOUNDS_KWARG, SP_KWARG
from hf_sp_trainer.mixers.checks import _lightning_ok, check_module
from hf_sp_trainer.mixers.swap import MODULE_ENTRIES
from tests.mixer_harness import lightning_layer

pytestmark = pytest.mark.unit  # in-process


def lightning_cases(world: int, ring: int) -> list[tuple[str, str, dict]]:
    """``tests/test_mixers.py`` cases: runs of 13 tokens over blocks of 4 (partial blocks), documents starting
    inside a run, at a run start and one token before it, one document over every run, 1-token documents, two
    rows; a block longer than a run; relay; and the negative control (``control_``: state passing off)."""
    run = 13
    total = run * world * (2 if ring > 1 else 1)
    layouts = {
        "start_inside": [[5, total - 5]],
        "start_at_run": [[run, total - run]],
        "start_1_before_run": [[run - 1, total - run + 1]],
        "one_document": [[total]],
        "1_token_documents": [[1, 1, run - 2, 1, total - run - 1]],
        "two_rows": [[5, total - 5], [total]],
    }
    key = f"lightning_w{world}_ring{ring}"
    cases = [(f"{key}_{name}", "lightning", dict(rows=rows, ring_size=ring)) for name, rows in layouts.items()]
    cases.append((f"{key}_block_16", "lightning", dict(rows=layouts["one_document"], ring_size=ring, block=16)))
    relay = dict(rows=layouts["start_inside"], ring_size=ring, relay=True)
    cases.append((f"relay_{key}_start_inside", "lightning", relay))
    control = dict(rows=layouts["one_document"], ring_size=ring, carry_state=False)
    cases.append((f"control_{key}_no_state_passing", "lightning", control))
    return cases


def test_check_holds_the_installed_forward() -> None:
    """The swap's check passes the installed forward and fails one whose recurrence differs (state leaking
    across blocks without decay) or that drops the output gate."""
    layer, _ = lightning_layer()
    cls = type(layer)
    forward = getattr(cls.forward, "_hf_sp_original", cls.forward)
    assert _lightning_ok(cls, forward)

    def ungated(self, hidden_states, *args, **kwargs):
        gate = self.output_gate
        self.output_gate = torch.nn.Identity()
        try:
            return forward(self, hidden_states * 0 + hidden_states, *args, **kwargs)
        finally:
            self.output_gate = gate

    def no_decay(self, hidden_states, *args, **kwargs):
        slope = self.slope_rate
        self.slope_rate = slope * 0
        try:
            return forward(self, hidden_states, *args, **kwargs)
        finally:
            self.slope_rate = slope

    assert not _lightning_ok(cls, ungated)
    assert not _lightning_ok(cls, no_decay)
    with pytest.raises(ValueError, match="no longer computes"):
        check_module(cls, no_decay)


def test_forward_without_sp_is_transformers() -> None:
    """Outside an SP forward (no bounds) the swapped forward is the installed one; under SP a cache is refused."""
    layer, _ = lightning_layer()
    forward = getattr(type(layer).forward, "_hf_sp_original", type(layer).forward)
    entry = MODULE_ENTRIES["MiniMaxLightningAttention"][1](forward)
    x = torch.randn(1, 9, 16)
    with torch.no_grad():
        assert torch.equal(entry(layer, x, None, None)[0], forward(layer, x, None, None)[0])
    from hf_sp_trainer.documents import DocumentHook
    from hf_sp_trainer.mixers.swap import attach_mixers
    from hf_sp_trainer.sharding import SequenceSharding

    documents = DocumentHook(None, SequenceSharding(1))
    attach_mixers(torch.nn.Sequential(layer), documents)
    sp = {BOUNDS_KWARG: torch.tensor([0, 9]), SP_KWARG: documents.context}
    with pytest.raises(ValueError, match="without a cache"):
        entry(layer, x, attention_mask=None, cache=object(), **sp)
