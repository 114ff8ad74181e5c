"""GRPO / RLOO with TRL's colocated vLLM engine under SP train exactly like the same run in one process."""

import pytest

from tests.exactness import EXACT, assert_exact
from tests.grpo_harness import diffs
from tests.vllm.rollout_cases import CONTROLS, WORLD2, WORLD4, reference, sp_results

pytestmark = [pytest.mark.vllm_rollouts, pytest.mark.dist]


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=lambda c: c.name)
def test_vllm_rollouts_match_one_process(case):
    got, ref = sp_results(case.world_size)[case.name], reference(case)
    assert got["sp_ranks_agree"]  # every rank of a group scored the same completions
    assert (got["split_generations"] > 0) == (case.sp_config.get("sp_generation") == "split")
    assert got["global_step"] == ref["global_step"] == case.steps
    assert ref["completions"] == got["completions"]  # the same completions drawn, in the same order
    assert any(e["grad_norm"] > 0 for e in ref["logs"])
    assert got["shards"]["sharded"] > 0  # the policy's scoring forwards ran on shards
    if case.trainer == "grpo":  # TRL's importance-sampling correction (vLLM's log-probs vs the trainer's)
        assert all(any(k.startswith("sampling/") for k in e) for e in got["logs"])
    found = diffs(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in found.items()})
    assert_exact(case.name, {k: v for k, v in found.items() if k != "update"})


@pytest.mark.parametrize("case", CONTROLS, ids=lambda c: c.name)
def test_negative_controls_are_caught(case):
    """A stale engine (its weights never synced) and a rank drawing with the wrong seeds both fail the comparison."""
    got, ref = sp_results(case.world_size)[case.name], reference(case)
    found = {k: v for k, v in diffs(ref, got).items() if k != "update"}
    print(case.name, {k: f"{v:.2e}" for k, v in found.items()})
    assert max(found.values()) > 100 * EXACT, found
