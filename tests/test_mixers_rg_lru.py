"""RecurrentGemma's recurrent block under SP (``hf_sp_trainer/mixers/rg_lru.py``): the layouts its kernel-level cases
run (in ``tests/test_mixers.py``'s spawned groups, against the installed block on each document alone), and, in
process, the swap's behaviour checks of the block and of the RG-LRU scan. The family: ``tests/test_model_families.py``;
Trainer-level: ``tests/test_equivalence_hybrid.py``."""

from __future__ import annotations

import pytest
import torch
from transformers.models.recurrent_gemma import modeling_recurrent_gemma as recurrent_gemma

from hf_sp_trainer.mixers.checks import _recurrent_block_ok, _rnn_scan_ok
from tests.test_mixers_mamba2 import layouts

pytestmark = pytest.mark.unit  # in-process

BLOCK, RGLRU = recurrent_gemma.RecurrentGemmaRecurrentBlock, recurrent_gemma.RecurrentGemmaRglru
FORWARD = getattr(BLOCK.forward, "_hf_sp_original", BLOCK.forward)
SCAN = getattr(RGLRU._rnn_scan, "_hf_sp_original", RGLRU._rnn_scan)


def rg_lru_cases(world: int, ring: int) -> list[tuple[str, str, dict]]:
    """``tests/test_mixers.py`` cases: every layout of ``test_mixers_mamba2``, two rows, a relayed one, and the
    negative control (``control_``: no state carried across runs)."""
    cases = layouts(world, ring)
    out = [
        (f"rg_lru_w{world}_ring{ring}_{name.replace(' ', '_')}", "rg_lru", dict(rows=[docs], ring_size=ring))
        for name, docs in cases.items()
    ]
    two_rows = [cases["start inside the second run"], cases["one document across every run"]]
    out.append((f"rg_lru_w{world}_ring{ring}_two_rows", "rg_lru", dict(rows=two_rows, ring_size=ring)))
    relay = dict(rows=[cases["start inside the second run"]], ring_size=ring, relay=True)
    out.append((f"relay_rg_lru_w{world}_ring{ring}_start_inside_second_run", "rg_lru", relay))
    control = dict(rows=[cases["one document across every run"]], ring_size=ring, carry_state=False)
    out.append((f"control_rg_lru_w{world}_ring{ring}_no_state_passing", "rg_lru", control))
    return out


def test_scan_check_holds_the_scan_to_its_initial_state() -> None:
    """The swap's check passes the installed RG-LRU scan and fails one that ignores the initial state (what the SP
    correction and the relay rely on)."""
    assert _rnn_scan_ok(RGLRU, SCAN)

    def stateless(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
        return SCAN(self, hidden_states, recurrent_gate, reset, None, acc_dtype)

    assert not _rnn_scan_ok(RGLRU, stateless)


def test_block_check_compares_with_the_installed_block_on_each_document() -> None:
    """The swap's check passes the installed block and fails a block that computes something else (its conv without
    its bias)."""
    assert _recurrent_block_ok(BLOCK, FORWARD)

    def biasless(self, input_states, **kwargs):
        bias = self.conv_1d.bias
        self.conv_1d.bias = None
        try:
            return FORWARD(self, input_states, **kwargs)
        finally:
            self.conv_1d.bias = bias

    assert not _recurrent_block_ok(BLOCK, biasless)


def test_outside_sp_the_swapped_methods_are_transformers() -> None:
    """Outside an SP forward (no bounds in the kwargs or the scope) both entries call the installed methods."""
    from hf_sp_trainer.mixers.swap import MODULE_ENTRIES
    from tests.mixer_harness import recurrent_block

    block = recurrent_block()
    forward = MODULE_ENTRIES["RecurrentGemmaRecurrentBlock"][1](FORWARD)
    scan = MODULE_ENTRIES["RecurrentGemmaRglru"][1](SCAN)
    x, a = torch.randn(1, 9, 16), torch.rand(1, 9, 16)
    kwargs = dict(position_ids=torch.arange(9)[None], attention_mask=None, use_cache=False)
    reset = torch.zeros(1, 9, 1, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(forward(block, x, **kwargs)[0], FORWARD(block, x, **kwargs)[0])
        ours = scan(block.rg_lru, hidden_states=x, recurrent_gate=a, reset=reset, recurrent_states=None)
        theirs = SCAN(block.rg_lru, hidden_states=x, recurrent_gate=a, reset=reset, recurrent_states=None)
        assert all(torch.equal(o, t) for o, t in zip(ours, theirs, strict=True))
