"""GRPO / RLOO with TRL's colocated vLLM engine, or a vLLM server, under SP train exactly like the same run in one
process (server cases: colocated ``split`` generation with the same per-row seeds)."""

import pytest

from tests.exactness import EXACT, assert_exact
from tests.grpo_harness import diffs
from tests.vllm.rollout_cases import CONTROLS, SERVER2, SERVER4, WORLD2, WORLD4, reference, sp_results

pytestmark = [pytest.mark.vllm_rollouts, pytest.mark.dist, pytest.mark.usefixtures("vllm_server")]


@pytest.mark.parametrize("case", WORLD2 + WORLD4 + SERVER2 + SERVER4, ids=lambda c: c.name)
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


def unreachable_server(tmp: str) -> str:
    """Build an SP GRPO trainer against a server nobody serves; the error this rank raised."""
    from hf_sp_trainer import GRPOConfig, SPGRPOTrainer
    from hf_sp_trainer.data import build_char_tokenizer
    from tests.grpo_harness import reward_len_and_vowels, rl_dataset
    from tests.harness import tiny_model
    from tests.pool import free_port
    from tests.vllm.rollout_cases import MODEL

    args = GRPOConfig(
        output_dir=tmp,
        sp_size=2,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=2,
        num_generations=2,
        ddp_backend="gloo",
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=f"http://127.0.0.1:{free_port()}",
        vllm_server_timeout=1,
    )
    try:
        SPGRPOTrainer(
            model=tiny_model("llama", **MODEL),
            reward_funcs=reward_len_and_vowels,
            args=args,
            train_dataset=rl_dataset(4, 0),
            processing_class=build_char_tokenizer(),
        )
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_an_unreachable_server_fails_on_every_rank(tmp_path):
    """The main process's client cannot reach the server: every rank raises (none waits in a collective)."""
    from tests.harness import run_distributed, unwrap_results

    errors = unwrap_results(run_distributed(2, unreachable_server, str(tmp_path), timeout=300))
    assert all("can't be reached" in e for e in errors), errors
