"""The spine: SPTrainer on 2 and 4 gloo processes trains exactly like plain Trainer in one process."""

import json
import os

import pytest

from tests.harness import (
    Case,
    assert_within,
    compare,
    run_distributed,
    run_sp_cases,
    train_case,
    unwrap_results,
)

TOL = 1e-5
WORLD2 = [
    Case("llama_sgd", optim="sgd"),
    Case("llama_adamw"),
    Case("llama_eager", attn="eager"),
    Case("llama_grad_accum2", grad_accum=2),
    Case("llama_uneven_last_batches", n_train=8, n_eval=5),
    Case("llama_grad_checkpointing", train_overrides={"gradient_checkpointing": True}),
    Case("llama_empty_shards", batch_size=1, masked_prompt=True, steps=4),
    Case("llama_gqa_kv1", model_overrides={"num_key_value_heads": 1}),
    Case("qwen2_sliding", family="qwen2"),
    Case("qwen3", family="qwen3", optim="sgd"),
    Case("mistral_sliding", family="mistral"),
    Case("mistral_sliding_eager", family="mistral", attn="eager", optim="sgd"),
    Case("gemma3", family="gemma3"),
    Case("phi3", family="phi3"),
]
WORLD4 = [
    Case("sp4_llama_gqa_kv2", sp_size=4, world_size=4),
    Case("sp4_qwen3_sgd", family="qwen3", optim="sgd", sp_size=4, world_size=4),
    Case("dp2sp2_llama_sgd", optim="sgd", sp_size=2, world_size=4),
    Case("dp2sp2_llama_adamw_ga2", grad_accum=2, sp_size=2, world_size=4),
    Case("dp2sp2_gemma3_eager", family="gemma3", attn="eager", sp_size=2, world_size=4),
]
REPORT = os.environ.get("HF_SP_EQUIVALENCE_REPORT")  # optional JSON file collecting the measured differences


@pytest.fixture(scope="module")
def sp_results():
    results = {}
    for world, cases in ((2, WORLD2), (4, WORLD4)):
        results[world] = run_distributed(world, run_sp_cases, cases)
    return results


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=lambda c: c.name)
def test_sp_matches_single_process(case, sp_results, tmp_path):
    got = unwrap_results(sp_results[case.world_size])[0][case.name]
    ref = train_case(case, sp=False, out_dir=str(tmp_path))
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"case": case.name, "sp": case.sp_size, "world": case.world_size, **diffs}) + "\n")
    assert got["global_step"] == ref["global_step"] == case.steps
    assert_within(case.name, diffs, TOL)
    if case.masked_prompt:
        assert got["empty_shards"] > 0, "the case was meant to contain shards whose labels are all -100"
