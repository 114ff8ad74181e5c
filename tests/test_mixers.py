"""The hybrid mixers' SP kernels (``hf_sp_trainer.mixers``: conv halo, state passing for Gated DeltaNet, Kimi delta
attention, Mamba1, Mamba2, MiniMax's lightning attention and RecurrentGemma's RG-LRU block) against transformers'
own kernels run on each document alone, over the layouts where a cross-rank bug would show: a document starting
inside a shard, exactly at a shard start, 1-2 tokens before it (inside the conv halo), one document over every
shard, 1-token documents, shards shorter than the conv width, runs not aligned to the kernel's chunks, two rows with
different documents; Ulysses (sp 2, 3, 4) and zigzag rings. Negative controls: state passing off and the halo off
must fail the same comparison. ``relay_`` cases: the state handed rank to rank (``tests/test_mixers_relay.py``)."""

from __future__ import annotations

import pytest

from tests.harness import EXACT, run_distributed, unwrap_results
from tests.mixer_harness import KERNEL_CALLS, run_checks
from tests.test_mixers_lightning import lightning_cases
from tests.test_mixers_mamba2 import mamba2_cases
from tests.test_mixers_relay import relay_cases
from tests.test_mixers_rg_lru import rg_lru_cases
from tests.test_mixers_selective import selective_cases

pytestmark = pytest.mark.matrix  # a big parametrised sweep over gloo worlds

LAYOUTS = {  # world size -> name -> (rows, ring size)
    2: {
        "start_inside": ([[13, 9, 18]], 1),
        "start_at_shard": ([[20, 20]], 1),
        "start_1_before_shard": ([[19, 21]], 1),
        "start_2_before_shard": ([[18, 22]], 1),
        "one_document": ([[40]], 1),
        "one_token_documents": ([[1, 19, 1, 1, 18]], 1),
        "two_rows": ([[13, 9, 18], [40]], 1),
        "ring2": ([[13, 9, 18]], 2),
        "ring2_one_document": ([[40]], 2),
    },
    3: {
        "sp3_start_inside": ([[15, 27]], 1),
        "sp3_start_at_shard": ([[14, 28]], 1),
        "sp3_one_document": ([[42]], 1),
        "sp3_shards_shorter_than_width": ([[2, 4]], 1),
    },
    4: {
        "sp4_one_document": ([[40]], 1),
        "sp4_start_inside": ([[13, 9, 18]], 1),
        "ring2x2_start_inside": ([[13, 9, 18]], 2),
        "ring2x2_one_document": ([[40]], 2),
        "ring2x2_one_token_runs": ([[3, 5]], 2),  # 8 tokens over 2 x 4 zigzag chunks of 1 token
    },
}
MANY_DOCUMENTS = [4, 3, 5, 2, 7, 1, 4, 3, 5, 6]  # 10 documents in 40 tokens, none starting at a shard (sp 2, 4)
GDN_EXTRA = {  # world size -> name -> kwargs of check_gdn
    2: {
        "chunk8_misaligned": dict(rows=[[13, 9, 18]], chunk=8),
        "strong_decay": dict(rows=[[13, 9, 18]], decay=5.0),
        "equal_heads": dict(rows=[[13, 9, 18]], heads=2, k_heads=2),
        "kda_start_inside": dict(rows=[[13, 9, 18]], kda=True),
        "kda_ring2_two_rows": dict(rows=[[13, 9, 18], [40]], ring_size=2, kda=True),
        # varlen: a rank's segments in one kernel call per list (from zero, widened, corrections)
        "varlen_start_inside": dict(rows=[[13, 9, 18]], varlen=True),
        "varlen_many_documents": dict(rows=[MANY_DOCUMENTS], varlen=True, chunk=4),
        "varlen_two_rows": dict(rows=[[13, 9, 18], [40]], varlen=True),
        "varlen_one_token_documents": dict(rows=[[1, 19, 1, 1, 18]], varlen=True),
        "varlen_kda_ring2_two_rows": dict(rows=[[13, 9, 18], [40]], ring_size=2, kda=True, varlen=True),
        "varlen_strong_decay": dict(rows=[[13, 9, 18]], decay=5.0, varlen=True),
    },
    4: {
        "kda_ring2x2_one_document": dict(rows=[[40]], ring_size=2, kda=True),
        "varlen_ring2x2_one_document": dict(rows=[[40]], ring_size=2, varlen=True),
        "varlen_ring2x2_many_documents": dict(rows=[MANY_DOCUMENTS, [40]], ring_size=2, varlen=True),
    },
}
CONTROLS = {  # must differ by far more than EXACT: a dropped state or halo is caught
    "no_state_passing": ("gdn", dict(rows=[[40]], carry_state=False)),
    "no_halo": ("conv", dict(rows=[[40]], halo=False)),
}


def _cases(world: int) -> list[tuple[str, str, dict]]:
    cases = []
    for name, (rows, ring) in LAYOUTS[world].items():
        cases += [(f"gdn_{name}", "gdn", dict(rows=rows, ring_size=ring))]
        cases += [(f"conv_{name}", "conv", dict(rows=rows, ring_size=ring))]
    cases += [(f"gdn_{name}", "gdn", kwargs) for name, kwargs in GDN_EXTRA.get(world, {}).items()]
    if world == 2:
        cases += [(f"control_{name}", kind, kwargs) for name, (kind, kwargs) in CONTROLS.items()]
    for ring in (1, 2) if world == 4 else (1,):
        cases += mamba2_cases(world, ring) + selective_cases(world, ring) + rg_lru_cases(world, ring)
    for ring in (1, 2) if world != 3 else (1,):
        cases += lightning_cases(world, ring)
    return cases + relay_cases(world)


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, float]]:
    out = {}
    for world in LAYOUTS:
        out.update(unwrap_results(run_distributed(world, run_checks, _cases(world), timeout=600))[0])
    return out


ALL = [name for world in LAYOUTS for name, _, _ in _cases(world) if not name.startswith("control_")]


@pytest.mark.parametrize("name", ALL)
def test_sp_kernel_matches_each_document_alone(name: str, results: dict) -> None:
    worst = max(v for k, v in results[name].items() if k != KERNEL_CALLS)
    print(name, {k: f"{v:.1e}" for k, v in results[name].items()})
    assert worst <= EXACT, f"{name}: {results[name]}"


CONTROL_NAMES = [name for world in LAYOUTS for name, _, _ in _cases(world) if name.startswith("control_")]


@pytest.mark.parametrize("name", CONTROL_NAMES)
def test_negative_controls_fail(name: str, results: dict) -> None:
    assert max(results[name].values()) > 1e-2, results[name]


BITWISE = [name for name in ALL if name.startswith("relay_bitwise_")]


@pytest.mark.parametrize("name", BITWISE)
def test_relay_is_bitwise_when_runs_are_chunk_aligned(name: str, results: dict) -> None:
    """With every run a whole number of the kernel's chunks, relaying the state computes what one device does,
    operation for operation: the output and every gradient equal the single-device ones exactly."""
    assert all(v == 0.0 for v in results[name].values()), results[name]


VARLEN = [name for name in ALL if name.startswith("gdn_varlen_")]


@pytest.mark.parametrize("name", VARLEN)
def test_varlen_calls_the_kernel_at_most_three_times(name: str, results: dict) -> None:
    """With a kernel taking ``cu_seqlens`` a rank's forward calls it once for its segments from zero, once for its
    runs with no document start (widened) and once for the corrections, however many documents it holds."""
    assert 1 <= results[name][KERNEL_CALLS] <= 3, results[name]


MAMBA2_VARLEN = [name for name in ALL if name.startswith("mamba2_") and "_varlen_" in name]


@pytest.mark.parametrize("name", MAMBA2_VARLEN)
def test_mamba2_varlen_scans_each_run_in_one_call(name: str, results: dict) -> None:
    """With a scan taking ``seq_idx`` a rank's forward scans each of its runs in one call (plus at most one
    correction per run), however many documents the run holds."""
    runs = 2 if "_ring2_" in name else 1
    assert 1 <= results[name][KERNEL_CALLS] <= 2 * runs, results[name]
