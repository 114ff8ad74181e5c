"""The session's gloo pool (``tests/pool.py``): a case starts as a freshly spawned rank did (the package's module
constants and functions included), and a case that fails or hangs leaves nothing behind for the next one."""

from __future__ import annotations

import os
import time

import pytest

from tests import pool
from tests.harness import run_distributed, unwrap_results

pytestmark = pytest.mark.dist  # the pool's own worlds


def _leave_a_mess(tmp: str) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    os.environ["HF_SP_POOL_TEST"] = "left over"
    os.environ.pop("OMP_NUM_THREADS")
    torch.set_default_dtype(torch.float64)
    torch.set_float32_matmul_precision("medium")
    torch.manual_seed(123)
    os.chdir(tmp)
    from hf_sp_trainer.attention import dsa, gathered_keys

    gathered_keys.GATHER_ABOVE, dsa.SCORE_BYTES = 0, 1024  # what the DSA kernel test once left for later cases
    dsa._streamed_topk = lambda *args, **kwargs: None
    return os.getpid()


def _what_a_case_sees() -> dict:
    import torch
    import torch.distributed as dist

    from hf_sp_trainer.attention import dsa, gathered_keys

    return {
        "pid": os.getpid(),
        "initialized": dist.is_initialized(),
        "env": (os.environ.get("HF_SP_POOL_TEST"), os.environ["OMP_NUM_THREADS"], os.environ["WORLD_SIZE"]),
        "rank": os.environ["RANK"],
        "dtype": str(torch.get_default_dtype()),
        "precision": (torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision),
        "seed": torch.initial_seed(),
        "cwd": os.getcwd(),
        "dsa": (gathered_keys.GATHER_ABOVE, dsa.SCORE_BYTES, dsa._streamed_topk.__name__),
    }


def test_a_case_starts_as_a_fresh_rank(tmp_path):
    before = unwrap_results(run_distributed(2, _what_a_case_sees))
    pids = unwrap_results(run_distributed(2, _leave_a_mess, str(tmp_path)))
    after = unwrap_results(run_distributed(2, _what_a_case_sees))
    assert [r["pid"] for r in after] == pids  # the same processes
    assert after == before
    assert [r["rank"] for r in after] == ["0", "1"] and not any(r["initialized"] for r in after)
    assert after[0]["env"] == (None, "1", "2") and after[0]["dtype"] == "torch.float32"
    assert after[0]["seed"] == 67280421310721  # torch's default seed, every case (a fresh rank's was arbitrary)
    fresh = unwrap_results(run_distributed(2, _what_a_case_sees, fresh=True))
    assert after[0]["dsa"] == (80, before[0]["dsa"][1], "_streamed_topk")  # the package's module state as imported
    same = ("initialized", "env", "rank", "dtype", "cwd", "dsa", "precision")
    assert [{k: r[k] for k in same} for r in fresh] == [{k: r[k] for k in same} for r in after]


def _fail() -> None:
    raise RuntimeError("this case fails")


def _hang() -> None:
    time.sleep(3600)


def test_a_failed_or_hung_case_gets_a_new_world():
    spawned = len(pool.spawned)
    first = unwrap_results(run_distributed(1, _what_a_case_sees))[0]
    failed = run_distributed(1, _fail)
    assert failed[0][0] == "error" and "this case fails" in failed[0][1]
    second = unwrap_results(run_distributed(1, _what_a_case_sees))[0]
    hung = run_distributed(1, _hang, timeout=2)
    assert hung[0][0] == "error" and "hung" in hung[0][1]
    third = unwrap_results(run_distributed(1, _what_a_case_sees))[0]
    assert len({first["pid"], second["pid"], third["pid"]}) == 3  # respawned after each
    assert len(pool.spawned) - spawned <= 3
    assert {k: v for k, v in first.items() if k != "pid"} == {k: v for k, v in third.items() if k != "pid"}


@pytest.mark.unit
def test_a_narrowed_session_runs_only_its_cases():
    """``harness.only_selected``: the cases a narrowed session's tests are parametrized by; every case when a selected
    test of a case module has no case parameter (it may read any case's run)."""
    import types

    import tests.harness as harness
    from tests.conftest import case_names
    from tests.harness import Case, only_selected
    from tests.test_grpo import test_split_sampled_generation_keeps_the_group_in_step as no_case_test

    grpo, families = types.ModuleType("tests.test_grpo"), types.ModuleType("tests.test_model_families")
    a, b, c = Case("a"), Case("b"), Case("c")
    assert case_names([(grpo, {"case": a}), (families, {"model_type": "llama"}), (grpo, {"case": c})]) == {"a", "c"}
    assert case_names([(grpo, {"case": a}), (grpo, {})]) is None  # e.g. the split-sampling test: every case
    assert no_case_test.__module__ == grpo.__name__  # (the module rule holds for that test)
    saved = harness.SELECTED_CASES
    try:
        harness.SELECTED_CASES = {"a", "c"}
        assert only_selected([a, b, c]) == [a, c]
        harness.SELECTED_CASES = None
        assert only_selected(iter([a, b, c])) == [a, b, c]
    finally:
        harness.SELECTED_CASES = saved
