"""SPGRPOTrainer / SPRLOOTrainer on 2 and 4 gloo processes train exactly like TRL (sampled completions, fp32)."""

import pytest
import torch

from tests.exactness import EXACT, assert_exact
from tests.grpo_harness import CASES, diffs, reference, sp_results
from tests.harness import assert_throughput_counts

pytestmark = pytest.mark.dist  # spawned gloo worlds (tests/pool.py); the tests marked otherwise below are not


@pytest.mark.parametrize("case", [c for c in CASES if c.compare], ids=lambda c: c.name)
def test_sp_rl_matches_trl(case):
    got = sp_results(case.world_size)[case.name]
    assert got["sp_ranks_agree"]  # every rank of a group scored the same completions
    assert (got["split_generations"] > 0) == (case.sp_config.get("sp_generation") == "split")
    ref = reference(case)
    assert got["global_step"] == ref["global_step"] == case.steps
    assert got["model_type"].removeprefix("FSDP") == ref["model_type"]  # FSDP2 renames the class it shards
    assert ("Peft" in got["model_type"]) == case.lora
    assert any(e["grad_norm"] > 0 for e in ref["logs"]) != case.no_op  # sampled completions differ: not a no-op
    assert len(got["evals"]) == int(case.evaluate)
    assert got["shards"]["sharded"] > 0  # the policy's scoring forwards ran on shards (generation did not)
    assert_throughput_counts(got["throughput_tokens"], got["shards"]["training_tokens"], case.name)
    if "sp_ring_size" not in case.sp_config:  # (zigzag gives rank 0 the row's first and last chunks)
        assert got["shards"]["crossing"] > 0  # some sequence is split between rank 0 and the next rank
    found = diffs(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in found.items()})
    found = {k: v for k, v in found.items() if k != "update"}  # informational: Adam's first steps amplify round-off
    if case.tol == EXACT:
        assert_exact(case.name, found)
    for key, value in found.items():
        assert value <= case.tol, f"{case.name}: {key} differs by {value:.3e} (relative)"


def test_split_sampled_generation_keeps_the_group_in_step():
    """sp_generation='split' with sampling: each rank samples half of the rows from its own stream; the group still
    scores the same completions, takes the same shuffles (grad accum 2) and trains."""
    got = sp_results(2)["grpo_sp2_split_sampled"]
    assert got["split_generations"] > 0 and got["sp_ranks_agree"]
    assert got["shards"]["sharded"] > 0 and all(e["grad_norm"] > 0 for e in got["logs"])


@pytest.mark.unit
@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_sp_size_1_is_trl(trainer, tmp_path):
    """In one process with sp_size=1 the SP trainers are TRL's own: every logged figure and parameter identical."""
    from tests.grpo_harness import RLCase, train_rl_case

    case = RLCase(f"{trainer}_sp1", trainer=trainer, sp_size=1, world_size=1, steps=1)
    ours = train_rl_case(case, sp=True, out_dir=str(tmp_path / "ours"))
    trl = train_rl_case(case, sp=False, out_dir=str(tmp_path / "trl"))
    assert ours["logs"] == trl["logs"] and ours["logs"][0]["grad_norm"] > 0
    for name, value in trl["params"].items():
        assert torch.equal(ours["params"][name], value), name
