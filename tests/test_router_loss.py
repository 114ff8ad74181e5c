"""The MoE router load-balancing loss under SP equals the single-device one (``hf_sp_trainer.losses.router``)."""

import importlib
import inspect
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from hf_sp_trainer.losses.router import computes_the_formula, router_sums
from tests.harness import (
    EXACT,
    Case,
    assert_case,
    compare,
    run_cases,
    run_distributed,
    tiny_model,
    train_case,
    unwrap_results,
)
from tests.sft_harness import SFTCase, train_sft_case

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

MODELS = "transformers.models.{0}.modeling_{0}"


# -- fast: the swapped function is still transformers' formula, and TRL still imports it from Mixtral ------------
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss", "qwen2_moe", "jetmoe"])
def test_installed_function_is_the_formula(family):
    assert computes_the_formula(importlib.import_module(MODELS.format(family)).load_balancing_loss_func)


def test_other_formulas_are_recognised():
    doge = importlib.import_module(MODELS.format("doge")).load_balancing_loss_func  # product-key experts
    assert not computes_the_formula(doge)


def test_trl_fused_head_imports_mixtrals_function():
    import trl.trainer.utils

    source = inspect.getsource(trl.trainer.utils.add_fused_lm_head)
    assert "from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func" in source


def test_router_sums_give_transformers_value_with_padding():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    logits = tuple(torch.randn(2 * 9, 5) for _ in range(3))
    mask = torch.ones(2, 9)
    mask[0, 6:] = 0
    counts, probs, rows = router_sums(logits, 5, 2, mask)
    assert rows == 3 * 15 and counts.sum() == 2 * rows
    ours = (counts / rows * probs / rows).sum() * 5
    torch.testing.assert_close(ours, load_balancing_loss_func(logits, 5, 2, mask))


# -- trainer-free: loss and every gradient, sp 2 and 4 (ring), against one process on the same packed row ---------
def _row():
    generator = torch.Generator().manual_seed(1)
    lengths = [7, 12, 4]  # 23 tokens: the SP padding (a document of its own) must stay out of the router loss
    ids = torch.randint(3, 128, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def _reference(family: str) -> tuple[float, dict]:
    model = tiny_model(family)
    out = model(**_row())
    out.loss.backward()
    return out.loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _sp_loss_and_grads(families: list[str], ring: int | None) -> dict:
    from hf_sp_trainer import apply_sequence_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    results = {}
    for family, detached in [(f, False) for f in families] + [(families[0], True)]:
        model = tiny_model(family)
        sp = apply_sequence_parallel(model, dist.get_world_size(), ring_size=ring)
        if detached:  # negative control: transformers' own function on each shard
            sp.router_loss.detach()
        batch = _row()
        count = (batch["labels"][:, 1:] != -100).sum()
        out = model(**sp.shard_batch(batch), num_items_in_batch=count)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = {}
        for name, p in model.named_parameters():
            grads[name] = p.grad.clone()
            dist.all_reduce(grads[name])
        sp.remove()
        results["control" if detached else family] = (loss.item(), grads)
    return results


def _grad_diff(got: dict, ref: dict) -> float:
    diff = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref)
    return (diff / sum(float(g.pow(2).sum()) for g in ref.values())) ** 0.5


@pytest.mark.dist
@pytest.mark.parametrize("world,ring", [(2, None), (4, 2)], ids=["sp2", "sp4_ring2"])
def test_loss_and_gradients_match_one_process(world, ring):
    families = ["mixtral", "qwen3_moe"]
    got = unwrap_results(run_distributed(world, _sp_loss_and_grads, families, ring))[0]
    for family in families:
        ref_loss, ref_grads = _reference(family)
        loss, grads = got[family]
        router = [k for k in ref_grads if k.endswith("gate.weight")]
        assert router, "the router's gradient must be compared"
        print(family, world, abs(loss - ref_loss) / ref_loss, _grad_diff(grads, ref_grads))
        assert abs(loss - ref_loss) <= EXACT * ref_loss
        assert _grad_diff(grads, ref_grads) <= EXACT
        assert _grad_diff({k: grads[k] for k in router}, {k: ref_grads[k] for k in router}) <= EXACT
    ref_loss, _ = _reference("mixtral")
    assert abs(got["control"][0] - ref_loss) > 1e-3 * ref_loss, "the per-shard router loss must differ"


# -- Trainer level: SPTrainer vs Trainer, SPSFTTrainer vs SFTTrainer (logged aux_loss too) -------------------------
TRAINER_CASES = [
    Case("mixtral_router_loss_sgd_ga2", family="mixtral", optim="sgd", grad_accum=2),
    Case("qwen3_moe_router_loss_ring", family="qwen3_moe", optim="sgd", sp_overrides={"sp_ring_size": 2}),
    Case("mixtral_router_loss_zero3", family="mixtral", optim="sgd", backend="zero3"),
]
DP2_CASES = [Case("mixtral_router_loss_dp2sp2", family="mixtral", optim="sgd", world_size=4)]
SFT_CASES = [SFTCase("sft_mixtral_router_loss_ga2", family="mixtral", config={"gradient_accumulation_steps": 2})]


def _ddp_references(cases: list) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return {c.name: train_case(c, sp=False, out_dir=os.path.join(tmp, c.name), ddp=True) for c in cases}


@pytest.fixture(scope="module")
def trainer_results():
    return {
        2: unwrap_results(run_distributed(2, run_cases, TRAINER_CASES + SFT_CASES))[0],
        4: unwrap_results(run_distributed(4, run_cases, DP2_CASES))[0],
        "ddp": unwrap_results(run_distributed(2, _ddp_references, DP2_CASES))[0],
    }


@pytest.mark.dist
@pytest.mark.parametrize("case", TRAINER_CASES + DP2_CASES, ids=lambda c: c.name)
def test_sp_trainer_router_loss_matches(case, trainer_results, tmp_path):
    got = trainer_results[case.world_size][case.name]
    if case.dp_size > 1:
        # dp 2: the router loss is a statistic of each data-parallel rank's batch, so training is compared with Trainer
        # on 2 DDP processes (what plain Trainer trains with 2 ranks). Evaluation is not: SP evaluates per batch as one
        # process does (the dp 1 cases), plain DDP scales each rank's batch loss, router term included, by token
        # counts gathered over the ranks.
        ref = {k: v for k, v in trainer_results["ddp"][case.name].items() if k not in ("eval_loss", "test_loss")}
        ref["predictions"] = None
        got = {k: v for k, v in got.items() if k not in ("eval_loss", "test_loss")}
    else:
        ref = train_case(case, sp=False, out_dir=str(tmp_path))
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert_case(case, diffs, ref, float64=case.dp_size == 1)  # dp 2: a DDP reference, no one-process float64 run


@pytest.mark.dist
@pytest.mark.parametrize("case", SFT_CASES, ids=lambda c: c.name)
def test_sp_sft_router_loss_matches(case, trainer_results, tmp_path):
    got = trainer_results[2][case.name]
    ref = train_sft_case(case, sp=False, out_dir=str(tmp_path))
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()}, got["aux_losses"], ref["aux_losses"])
    for key in ("loss", "grad_norm", "eval_loss", "params"):
        assert diffs[key] <= EXACT, f"{case.name}: {key} differs by {diffs[key]:.3e} (relative)"
    assert len(got["aux_losses"]) == len(ref["aux_losses"]) == case.steps
    for a, b in [*zip(got["aux_losses"], ref["aux_losses"], strict=True), (got["eval_aux_loss"], ref["eval_aux_loss"])]:
        assert abs(a - b) <= EXACT * abs(b)
