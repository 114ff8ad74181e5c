"""Relay state passing (``hf_sp_trainer/mixers/relay.py``, ``sp_state_passing="relay"``): the kernel-level cases
``tests/test_mixers.py`` runs in its spawned groups (against each document alone, like the default gather; with runs
aligned to Gated DeltaNet's chunks, bitwise), and, in process, the argument's validation. Trainer level:
``tests/test_equivalence_hybrid.py``'s ``relay_`` cases."""

from __future__ import annotations

import pytest

from hf_sp_trainer import TrainingArguments
from hf_sp_trainer.mixers.swap import check_state_passing
from tests.test_mixers_mamba2 import layouts

pytestmark = pytest.mark.unit  # in-process

RELAY = dict(relay=True)


def _mamba2(world: int, ring: int, layout: str) -> dict:
    return dict(docs=layouts(world, ring)[layout], ring_size=ring, **RELAY)


def relay_cases(world: int) -> list[tuple[str, str, dict]]:
    """``relay_`` cases of ``tests/test_mixers.py`` for a group of ``world`` processes; ``relay_bitwise_`` ones must
    equal the single-device result exactly (every run a whole number of the kernel's chunks)."""
    aligned = dict(rows=[[16 * world]], chunk=8, **RELAY)  # one document, 2 chunks of 8 per rank
    if world == 2:
        return [
            ("relay_gdn_start_inside", "gdn", dict(rows=[[13, 9, 18]], **RELAY)),
            ("relay_gdn_two_rows", "gdn", dict(rows=[[13, 9, 18], [40]], **RELAY)),
            ("relay_gdn_ring2", "gdn", dict(rows=[[13, 9, 18]], ring_size=2, **RELAY)),
            ("relay_kda_ring2", "gdn", dict(rows=[[40]], ring_size=2, kda=True, **RELAY)),
            ("relay_bitwise_gdn_sp2", "gdn", aligned),
            ("relay_mamba2_start_inside_second_run", "mamba2", _mamba2(2, 1, "start inside the second run")),
            ("relay_mamba2_ring2_1_token_documents", "mamba2", _mamba2(2, 2, "1-token documents")),
        ]
    if world == 3:
        return [("relay_gdn_sp3_shards_shorter_than_width", "gdn", dict(rows=[[2, 4]], **RELAY))]
    return [
        ("relay_gdn_ring2x2_one_document", "gdn", dict(rows=[[40]], ring_size=2, **RELAY)),
        ("relay_bitwise_gdn_ring2x2", "gdn", dict(ring_size=2, **aligned)),
        ("relay_mamba2_ring2x2_start_inside", "mamba2", _mamba2(4, 2, "start inside a run")),
    ]


def test_state_passing_is_validated() -> None:
    check_state_passing("gather")
    check_state_passing("relay")
    with pytest.raises(ValueError, match=r"sp_state_passing='ring' is not one of \['gather', 'relay'\]"):
        check_state_passing("ring")
    assert TrainingArguments(output_dir="unused", use_cpu=True).sp_state_passing == "gather"
    with pytest.raises(ValueError, match="sp_state_passing='pipe'"):
        TrainingArguments(output_dir="unused", use_cpu=True, sp_state_passing="pipe")
