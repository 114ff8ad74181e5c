"""Tiled MLP: the same MLP to fp32 round-off on every supported family, one gradient accumulation per parameter and
call, and training equal to plain single-process training — under SP=2 (DDP over the SP group), FSDP2 and ZeRO-3,
with gradient checkpointing and the other memory features, and with LoRA on an MLP linear (SPSFTTrainer)."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter

import pytest
import torch

from hf_sp_trainer.memory.tiled_mlp import TiledMLP, apply_tiled_mlp, remove_tiled_mlp
from tests.harness import (
    EXACT,
    FAMILIES,
    FP64_EXACT,
    Case,
    assert_case,
    compare,
    enable_checkpointing,
    run_cases,
    run_distributed,
    tiny_model,
    unwrap_results,
)
from tests.sft_harness import SFTCase, reference_run

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

TILED = {"tiled_mlp": True, "tiled_mlp_num_shards": 3}
ALL_FEATURES = TILED | {"checkpoint_policy": "sequence_aware", "checkpoint_offloading": True, "fused_loss": True}
CASES = [
    Case("tiled_llama_sp2", sp_overrides=TILED),
    Case(
        "tiled_gemma3_all_memory_features_sp2",
        family="gemma3",
        train_overrides={"gradient_checkpointing": True},
        sp_overrides=ALL_FEATURES,
    ),
    Case("tiled_fsdp2_sp2", backend="fsdp2", sp_overrides=TILED),
    Case("tiled_zero3_sp2", backend="zero3", sp_overrides=TILED),
]
SFT_CASES = [SFTCase("tiled_lora_sft_sp2", lora=True, config=TILED)]  # LoRA on up_proj; TRL checkpoints by default


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-30)) for n in b)


# ----------------------------------------------------------------------------------------------------------------
# one process
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiled_mlp_is_the_mlp(family):
    """In float64: tiling reorders the MLP's weight-gradient sums, whose fp32 round-off depends on the host's kernels
    (Doge 2.3e-5 under ``MKL_ENABLE_INSTRUCTIONS=AVX2``)."""
    ref = tiny_model(family).double().train()
    model = copy.deepcopy(ref)
    assert apply_tiled_mlp(model, num_shards=4) == ref.config.num_hidden_layers
    assert list(model.state_dict()) == list(ref.state_dict())  # names unchanged
    calls = Counter()
    for name, module in model.named_modules():
        if name.endswith("mlp.down_proj"):
            module.register_forward_hook(lambda *_, n=name: calls.update([n]))
    ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    loss, grads = _loss_and_grads(model, ids)
    assert set(calls.values()) == {4 + 4}  # 4 tiles in forward, each recomputed once in backward
    assert abs(float(loss - ref_loss)) <= FP64_EXACT * abs(float(ref_loss))
    assert _max_rel(grads, ref_grads) <= 1e3 * FP64_EXACT  # relative per tensor: small gradients' own round-off
    remove_tiled_mlp(model)
    assert not any(isinstance(m, TiledMLP) for m in model.modules())


@pytest.mark.parametrize("lora, checkpointing", [(False, False), (True, False), (True, True)])
def test_each_parameter_gradient_is_accumulated_once(lora, checkpointing):
    """DDP / FSDP2 / ZeRO reduce a gradient when it is accumulated: once per MLP call, however many tiles. With
    LoRA on every MLP linear the layer-0 MLP input does not require grad (frozen embeddings), the weights do."""
    import peft

    ref = tiny_model("llama").train()
    if lora:
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj"]
        )
        ref = peft.get_peft_model(ref, config)
        torch.nn.init.normal_(ref.base_model.model.model.layers[0].mlp.up_proj.lora_B.default.weight)
    if checkpointing:
        enable_checkpointing(ref.base_model.model)
    model = copy.deepcopy(ref)
    apply_tiled_mlp(model, num_shards=5)
    accumulations = Counter()
    for name, p in model.named_parameters():
        if ".mlp." in name and p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, n=name: accumulations.update([n]))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    _, ref_grads = _loss_and_grads(ref, ids)
    _, grads = _loss_and_grads(model, ids)
    assert len(accumulations) == (12 if lora else 6) and set(accumulations.values()) == {1}
    assert _max_rel(grads, ref_grads) <= EXACT


def test_unrecognised_mlp_and_bad_tile_count_raise():
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has 1 decoder layers and unsupported parts \['GPT2MLP'\]"):
        apply_tiled_mlp(gpt2)
    with pytest.raises(ValueError, match="tiled_mlp_num_shards must be a positive"):
        apply_tiled_mlp(tiny_model("llama"), num_shards=0)


def test_tiled_mlp_evaluation_and_default_tile_count():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        apply_tiled_mlp(model)  # ceil(200 / hidden 64) = 4 tiles
        got = model(input_ids=ids).logits
    assert float((got - ref).norm() / ref.norm()) <= EXACT


# ----------------------------------------------------------------------------------------------------------------
# training: SP=2 under DDP, FSDP2, ZeRO-3, LoRA
# ----------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def count_tiled_calls(_case):
    """A ``run_cases`` probe: how many tiled MLP forwards the case ran."""
    counts = {"tiled_calls": 0}

    def hook(module, *_):
        if isinstance(module, TiledMLP):
            counts["tiled_calls"] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield counts
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def sp_results():
    return unwrap_results(run_distributed(2, run_cases, SFT_CASES + CASES, count_tiled_calls))[0]


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES + SFT_CASES, ids=lambda c: c.name)
def test_tiled_mlp_trains_like_plain_single_process(case, sp_results, tmp_path):
    got = sp_results[case.name]
    assert got["tiled_calls"] > 0
    ref = reference_run(case, str(tmp_path))
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert got["global_step"] == case.steps
    assert_case(case, diffs, ref)
