"""Resuming a checkpoint on another layout trains the same steps as the uninterrupted run (issue 54, items 1-2).

Each cell: the uninterrupted run on layout A (4 steps, saving at step 2), then a fresh run on layout B resumed from
``checkpoint-2``; steps 3-4 (loss, grad_norm) and the final weights equal the uninterrupted run's within 1e-5
(relative). The global batch (dp x per-device batch x accumulation) is 4 everywhere. One run per (trainer, backend,
layout A) serves its cells; every run of a world size goes in one ``run_distributed`` call (the 2-process one first:
the 4-process cells resume its checkpoints).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from hf_sp_trainer.trainers.resume import Layout, check_generation, check_layouts
from tests.harness import (
    Case,
    backend_args,
    build_trainer,
    full_parameters,
    logged_steps,
    params_rel,
    quiet_args,
    rel,
    reset_backend_state,
    run_distributed,
    synthetic_dataset,
    tiny_model,
    unwrap_results,
)

pytestmark = pytest.mark.dist

TOL = 1e-5
SHORT = dict(steps=4, min_len=6, max_len=24)
LAYOUTS = {  # (sp_size, world_size, per-device batch, accumulation, extra SP arguments): global batch 4
    "sp2": dict(sp_size=2, world_size=2, batch_size=4),
    "dp2sp1": dict(sp_size=1, world_size=2, batch_size=2),
    "dp1sp4": dict(sp_size=4, world_size=4, batch_size=4),
    "sp4_u2r2": dict(sp_size=4, world_size=4, batch_size=4, sp_overrides={"sp_ring_size": 2}),
    "dp1sp2_ga2": dict(sp_size=2, world_size=2, batch_size=2, grad_accum=2),
    "dp2sp2": dict(sp_size=2, world_size=4, batch_size=2),
}
CHANGES = [("sp2", "sp4_u2r2"), ("dp2sp1", "dp1sp2_ga2"), ("dp1sp4", "dp2sp2")]


def case(backend: str, layout: str, kind: str = "trainer", **kw) -> Case:
    """``layout``'s case on ``backend``; ``family`` carries the trainer to build (trainer | lora | sft | grpo, each on
    the tiny llama)."""
    prefix = backend if kind == "trainer" else f"{kind}_{backend}"
    return Case(f"{prefix}_{layout}", backend=backend, family=kind, **SHORT, **{**LAYOUTS[layout], **kw})


@dataclass(frozen=True)
class Cell:
    """Layout ``a``'s uninterrupted run, resumed at step 2 on layout ``b``; ``expect``: "exact", "differs" (a
    negative control) or "error" (the layout check refuses ``b``)."""

    name: str
    a: Case
    b: Case
    expect: str = "exact"


def cells(backend: str, kind: str = "trainer", changes=CHANGES) -> list[Cell]:
    return [
        Cell(f"{case(backend, a, kind).name}_to_{b}", case(backend, a, kind), case(backend, b, kind))
        for a, b in changes
    ]


MATRIX = cells("ddp") + cells("fsdp2") + cells("zero3")
EXTRA = cells("ddp", "lora", CHANGES[1:2]) + cells("ddp", "sft", CHANGES[1:2])
EXTRA += cells("ddp", "grpo", [CHANGES[0], ("dp2sp1", "dp2sp2")])  # dp 2 kept: ranks 2, 3 draw as saved rank 1 did
CONTROL = Cell(  # the same resume ignoring the data position: steps 3-4 retrain the batches of steps 1-2
    "control_ddp_dp2sp1_data_skip_ignored",
    case("ddp", "dp2sp1"),
    case("ddp", "dp1sp2_ga2", train_overrides={"ignore_data_skip": True}),
    expect="differs",
)
WRONG_BATCH = Cell("error_ddp_dp2sp1_to_sp2_batch2", case("ddp", "dp2sp1"), case("ddp", "sp2", batch_size=2), "error")
CELLS = MATRIX + EXTRA + [CONTROL, WRONG_BATCH]


# ----------------------------------------------------------------------------------------------------------------
# the runs (in the pool's ranks)
# ----------------------------------------------------------------------------------------------------------------
def build(c: Case, out_dir: str, **extra):
    """The ``SPTrainer`` / LoRA / SFT-with-packing / GRPO trainer of ``c`` (``c.family`` names which)."""
    if c.family == "trainer":
        return build_trainer(c.with_(family="llama"), True, out_dir, **extra)[1]
    import peft

    import hf_sp_trainer as hst
    from hf_sp_trainer.data import build_char_tokenizer

    reset_backend_state()
    model = tiny_model("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    args = quiet_args(out_dir, c.steps) | extra | dict(learning_rate=1e-3, ddp_backend="gloo", sp_size=c.sp_size)
    args |= dict(per_device_train_batch_size=c.batch_size, gradient_accumulation_steps=c.grad_accum)
    args |= backend_args(c.backend) | c.sp_overrides | c.train_overrides
    if c.family == "lora":
        torch.manual_seed(0)
        model = peft.get_peft_model(model, lora)
        train = synthetic_dataset(c.batch_size * c.dp_size * c.grad_accum * c.steps, seed=1, max_len=24)
        return hst.SPTrainer(
            model=model, args=hst.TrainingArguments(remove_unused_columns=False, **args), train_dataset=train
        )
    if c.family == "sft":
        from tests.sft_harness import sft_dataset

        config = hst.SFTConfig(packing=True, max_length=48, dataset_num_proc=None, bf16=False, **args)
        train = sft_dataset("text", 48, seed=11)
        return hst.SPSFTTrainer(model=model, args=config, train_dataset=train, processing_class=build_char_tokenizer())
    from tests.grpo_harness import reward_len_and_vowels, rl_dataset

    args |= dict(num_generations=2, max_completion_length=12, bf16=False, beta=0.0, shuffle_dataset=False, seed=7)
    config = hst.GRPOConfig(**args)
    return hst.SPGRPOTrainer(
        model=model,
        reward_funcs=reward_len_and_vowels,
        args=config,
        train_dataset=rl_dataset(16, seed=31),
        processing_class=build_char_tokenizer(),
    )


def full_dir(tmp: str, a: Case) -> str:
    return os.path.join(tmp, "full", a.name)


def result(trainer) -> dict:
    params = full_parameters(trainer.model)  # collective: every rank
    rank0 = dist.get_rank() == 0
    return {
        "steps": logged_steps(trainer),
        "params": params if rank0 else None,
        "global_step": trainer.state.global_step,
    }


def run_full(a: Case, tmp: str) -> dict:
    trainer = build(a, full_dir(tmp, a), save_strategy="steps", save_steps=2)
    trainer.train()
    return result(trainer)


def run_resumed(cell: Cell, tmp: str) -> dict:
    trainer = build(cell.b, os.path.join(tmp, "resumed", cell.name))
    checkpoint = os.path.join(full_dir(tmp, cell.a), "checkpoint-2")
    if cell.expect != "error":
        trainer.train(resume_from_checkpoint=checkpoint)
        return result(trainer)
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    except ValueError as exc:
        return {"error": str(exc), "global_step": trainer.state.global_step}
    return {"error": None}


def world_jobs(world: int, todo: list[Cell], tmp: str) -> dict[str, dict]:
    """On every rank of the ``world``-process world: the uninterrupted runs of the layouts A on it, then the resumed
    runs of the layouts B on it (an error cell: what each rank raised, in ``ranks``)."""
    out = {}
    for a in {c.a.name: c.a for c in todo if c.a.world_size == world}.values():
        out[a.name] = run_full(a, tmp)
    for cell in todo:
        if cell.b.world_size == world:
            out[cell.name] = run_resumed(cell, tmp)
            if cell.expect == "error":  # what every rank raised
                out[cell.name]["ranks"] = [None] * world
                dist.all_gather_object(out[cell.name]["ranks"], out[cell.name]["error"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("layouts"))
    out = {}
    for world in (2, 4):
        out |= unwrap_results(run_distributed(world, world_jobs, world, CELLS, tmp))[0]
    return out


def cell_diffs(cell: Cell, runs: dict) -> dict[str, float]:
    full, resumed = runs[cell.a.name], runs[cell.name]
    assert len(full["steps"]) == len(resumed["steps"]) == 4, (full["steps"], resumed["steps"])
    pairs = list(zip(resumed["steps"][2:], full["steps"][2:], strict=True))
    return {
        "loss": max(rel(got[0], ref[0]) for got, ref in pairs),
        "grad_norm": max(rel(got[1], ref[1]) for got, ref in pairs),
        "params": params_rel(resumed["params"], full["params"]),
    }


# ----------------------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cell", MATRIX + EXTRA, ids=lambda c: c.name)
def test_resume_on_another_layout_matches_uninterrupted_run(cell, runs):
    diffs = cell_diffs(cell, runs)
    print(cell.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert runs[cell.name]["global_step"] == 4
    assert max(diffs.values()) <= TOL, (cell.name, diffs)


def test_control_shifted_data_position_is_caught(runs):
    diffs = cell_diffs(CONTROL, runs)
    print(CONTROL.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert diffs["loss"] > 1e-3, diffs


def test_changed_global_batch_is_refused_before_training(runs):
    run = runs[WRONG_BATCH.name]
    assert run["error"] is not None and run["global_step"] == 0, run
    assert run["ranks"] == [run["error"]] * 2, run  # the same error on every rank
    for text in (
        "global batch (dp x per_device_train_batch_size x gradient_accumulation_steps) would change from 4 to 2",
        "dp 2 x sp 1",
        "dp 1 x sp 2",
        "(2, 2), (4, 1)",
    ):
        assert text in run["error"], run["error"]


LAYOUT = dict(world_size=2, dp_size=2, sp_size=1, ring_size=1, per_device_train_batch_size=2)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (dict(world_size=4, dp_size=2, sp_size=2, per_device_train_batch_size=2, gradient_accumulation_steps=1), None),
        (
            dict(world_size=2, dp_size=1, sp_size=2, per_device_train_batch_size=2, gradient_accumulation_steps=1),
            r"set per_device_train_batch_size x gradient_accumulation_steps = 4: .* in \(2, 2\), \(4, 1\), \(1, 4\)",
        ),
        (
            dict(world_size=6, dp_size=3, sp_size=2, per_device_train_batch_size=1, gradient_accumulation_steps=1),
            r"does not divide over dp 3: use a dp size in \[1, 2, 4\] \(world sizes 2, 4, 8 at sp_size=2\)",
        ),
        (
            dict(world_size=2, dp_size=2, sp_size=1, gradient_accumulation_steps=1, backend="zero3"),
            "written by ddp, whose model and optimizer state zero3 doesn't load",
        ),
    ],
)
def test_layout_check(now, expected):
    saved = Layout(**LAYOUT, gradient_accumulation_steps=1, backend="ddp")
    now = Layout(**{**LAYOUT, "ring_size": 1, "backend": "ddp", **now})
    if expected is None:
        check_layouts(saved, now, "ckpt")
    else:
        with pytest.raises(ValueError, match=expected):
            check_layouts(saved, now, "ckpt")


@pytest.mark.unit
def test_online_rl_keeps_dp():
    saved = Layout(**LAYOUT, gradient_accumulation_steps=1, backend="ddp")
    now = Layout(
        **{**LAYOUT, "world_size": 2, "dp_size": 1, "sp_size": 2}, gradient_accumulation_steps=2, backend="ddp"
    )
    with pytest.raises(ValueError, match=r"SPGRPOTrainer samples .* Keep dp 2: world size 2 \(sp_size=1\), 4"):
        check_layouts(saved, now, "ckpt", "SPGRPOTrainer")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("step", "args", "expected"),
    [
        (2, dict(), None),
        (3, dict(steps_per_generation=2), "saved after 3 micro-steps, inside a block of 2"),
        (2, dict(sp_generation="split"), "sp_generation='split' samples each SP rank's share"),
        (2, dict(sp_generation="split", use_vllm=True), None),
    ],
)
def test_online_rl_generation_checks(tmp_path, step, args, expected):
    from types import SimpleNamespace

    from transformers import TrainerState

    TrainerState(global_step=step).save_to_json(str(tmp_path / "trainer_state.json"))
    config = SimpleNamespace(**{"steps_per_generation": 1, "sp_generation": "replicate", "use_vllm": False, **args})
    trainer = SimpleNamespace(args=config, num_iterations=1)
    saved = Layout(**LAYOUT, gradient_accumulation_steps=1, backend="ddp")
    now = Layout(**{**LAYOUT, "world_size": 4, "sp_size": 2}, gradient_accumulation_steps=1, backend="ddp")
    if expected is None:
        check_generation(trainer, saved, now, str(tmp_path))
    else:
        with pytest.raises(ValueError, match=expected):
            check_generation(trainer, saved, now, str(tmp_path))
