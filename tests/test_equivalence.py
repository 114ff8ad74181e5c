"""The spine: SPTrainer on 2 and 4 gloo processes trains exactly like plain Trainer in one process."""

import json
import os

import pytest

from tests.harness import (
    Case,
    assert_case,
    compare,
    only_selected,
    sp_runs_by_world,
)

pytestmark = pytest.mark.dist  # spawned gloo worlds (tests/pool.py)

RING2 = {"sp_ring_size": 2}
THREE_HEADS = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
SIX_HEADS = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}
MEMORY_STACK = {"tiled_mlp": True, "tiled_mlp_num_shards": 2, "fused_loss": True, "checkpoint_policy": "sequence_aware"}
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
    # attention called without **kwargs (SP relays its kwargs past the layer), also through a checkpoint recompute
    Case("nemotron_grad_ckpt", family="nemotron", optim="sgd", train_overrides={"gradient_checkpointing": True}),
    # ring attention (ulysses 1 x ring 2): packed rows straddle the zigzag chunks, windows, GQA, 1-token documents
    Case("ring2_llama", sp_overrides=RING2),
    Case("ring2_3_heads_auto_split", model_overrides=THREE_HEADS),  # 3 heads: sp 2 can only be a ring
    Case("ring2_mistral_window_ga2", family="mistral", grad_accum=2, sp_overrides=RING2),
    Case("ring2_gemma3_eager", family="gemma3", attn="eager", sp_overrides=RING2),
    Case("ring2_one_token_docs", min_len=1, max_len=12, batch_size=4, sp_overrides=RING2),
    Case("ring2_memory_stack", train_overrides={"gradient_checkpointing": True}, sp_overrides=RING2 | MEMORY_STACK),
]
REBALANCE = {"train_sampling_strategy": "batch_rebalance"}  # both runs: the same examples in each optimizer step
WORLD4 = [
    Case("sp4_llama_gqa_kv2", sp_size=4, world_size=4),
    Case("dp2sp2_rebalanced_ga2", grad_accum=2, world_size=4, min_len=2, max_len=60, train_overrides=REBALANCE),
    Case("sp4_qwen3_sgd", family="qwen3", optim="sgd", sp_size=4, world_size=4),
    Case("dp2sp2_llama_sgd", optim="sgd", sp_size=2, world_size=4),
    Case("dp2sp2_llama_adamw_ga2", grad_accum=2, sp_size=2, world_size=4),
    Case("dp2sp2_gemma3_eager", family="gemma3", attn="eager", sp_size=2, world_size=4),
    Case("ring4_llama", sp_size=4, world_size=4, sp_overrides={"sp_ring_size": 4}),
    Case("hybrid2x2_kv1", sp_size=4, world_size=4, model_overrides={"num_key_value_heads": 1}, sp_overrides=RING2),
    Case("hybrid2x2_6_heads_auto_split", sp_size=4, world_size=4, model_overrides=SIX_HEADS),  # ulysses 2 x ring 2
    Case("dp2_ring2_qwen2_window", family="qwen2", optim="sgd", sp_size=2, world_size=4, sp_overrides=RING2),
]
REPORT = os.environ.get("HF_SP_EQUIVALENCE_REPORT")  # optional JSON file collecting the measured differences


@pytest.fixture(scope="module")
def sp_results():
    return sp_runs_by_world(only_selected(WORLD2 + WORLD4))


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=lambda c: c.name)
def test_sp_matches_single_process(case, sp_results):
    got, ref = sp_results.got(case), sp_results.reference(case)
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"case": case.name, "sp": case.sp_size, "world": case.world_size, **diffs}) + "\n")
    assert got["global_step"] == ref["global_step"] == case.steps
    assert_case(case, diffs, ref)
    if case.masked_prompt:
        assert got["empty_shards"] > 0, "the case was meant to contain shards whose labels are all -100"
