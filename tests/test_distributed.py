"""SP on every distributed backend: FSDP2 and DeepSpeed ZeRO 1/2/3 (with CPU offload) train exactly like plain
``Trainer`` in one process (DDP is the default of tests/test_equivalence.py); bf16 stays within bf16 tolerance;
saving and resuming reproduces the uninterrupted run."""

import json
import os

import pytest
from accelerate import ParallelismConfig
from transformers import TrainerCallback

from tests.harness import (
    BF16_TOL,
    EXACT,
    Case,
    assert_case,
    build_trainer,
    compare,
    logged_steps,
    run_distributed,
    sp_runs_by_world,
    unwrap_results,
)

pytestmark = pytest.mark.dist  # spawned gloo worlds (tests/pool.py); the tests marked otherwise below are not

WORLD2 = [
    Case("fsdp2_sp2", backend="fsdp2"),
    Case("zero1_sp2", backend="zero1"),
    Case("zero2_sp2_ga2", backend="zero2", grad_accum=2),
    Case("zero3_sp2", backend="zero3"),
    Case("zero2_offload_sp2", backend="zero2+offload"),
    Case("zero3_offload_sp2", backend="zero3+offload"),
    Case("ddp_sp2_bf16", sp_overrides={"bf16": True}, tol=BF16_TOL),
    Case("fsdp2_sp2_bf16", backend="fsdp2", sp_overrides={"bf16": True}, tol=BF16_TOL),
    Case("zero2_sp2_bf16", backend="zero2", sp_overrides={"bf16": True}, tol=BF16_TOL),
]
WORLD4 = [
    Case("fsdp2_dp2sp2_ga2", backend="fsdp2", world_size=4, grad_accum=2),
    Case("zero1_dp2sp2", backend="zero1", world_size=4),
    Case("zero2_dp2sp2", backend="zero2", world_size=4),
    Case("zero3_dp2sp2_ga2", backend="zero3", world_size=4, grad_accum=2),
    Case("zero3_offload_dp2sp2", backend="zero3+offload", world_size=4),
]
# accelerate's ways of asking for SP, routed to ours (sp_size left at its default 1)
ROUTES = [
    Case("route_config_sp2", sp_overrides={"sp_size": 1, "parallelism_config": ParallelismConfig(sp_size=2)}),
    Case("route_env_sp2", env={"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}),
]
ROUTES4 = [
    Case(
        "route_fsdp2_dp_shard2_sp2",
        backend="fsdp2",
        world_size=4,
        sp_overrides={"sp_size": 1, "parallelism_config": ParallelismConfig(dp_shard_size=2, sp_size=2)},
    ),
]
WORLD2 += ROUTES
WORLD4 += ROUTES4
RESUME = [Case(f"resume_{b}", backend=b, steps=4) for b in ("ddp", "fsdp2", "zero2", "zero3")]
REPORT = os.environ.get("HF_SP_EQUIVALENCE_REPORT")


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def resume_runs(cases: list[Case], tmp: str) -> dict[str, dict]:
    """Per case: the uninterrupted run (saving at step 2) and a fresh run resumed from that checkpoint."""
    out = {}
    for case in cases:
        full_dir = os.path.join(tmp, case.name, "full")
        _, trainer, _ = build_trainer(case, True, full_dir, save_strategy="steps", save_steps=2)
        trainer.train()
        uninterrupted = logged_steps(trainer)
        _, trainer, _ = build_trainer(case, True, os.path.join(tmp, case.name, "resumed"))
        steps = StepCounter()
        trainer.add_callback(steps)
        trainer.train(resume_from_checkpoint=os.path.join(full_dir, "checkpoint-2"))
        out[case.name] = {"uninterrupted": uninterrupted, "resumed": logged_steps(trainer), "steps": steps.steps}
    return out


@pytest.fixture(scope="module")
def sp_results():
    return sp_runs_by_world(WORLD2, WORLD4)


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=lambda c: c.name)
def test_backend_matches_single_process(case, sp_results):
    got, ref = sp_results.got(case), sp_results.reference(case)
    diffs = compare(ref, got)
    print(case.name, f"{got['seconds']:.1f}s", {k: f"{v:.2e}" for k, v in diffs.items()})
    if REPORT:
        with open(REPORT, "a") as f:
            row = {"case": case.name, "backend": case.backend, "sp": case.sp_size, "world": case.world_size}
            f.write(json.dumps({**row, "seconds": got["seconds"], **diffs}) + "\n")
    assert got["global_step"] == ref["global_step"] == case.steps
    if case.sp_overrides.get("bf16"):
        assert diffs["params"] > EXACT, f"{case.name}: bf16 was not applied (fp32-exact results)"
    assert_case(case, diffs, ref, case.tol)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return unwrap_results(run_distributed(2, resume_runs, RESUME, str(tmp_path_factory.mktemp("resume"))))[0]


@pytest.mark.parametrize("case", RESUME, ids=lambda c: c.name)
def test_resume_reproduces_uninterrupted_run(case, resumed):
    run = resumed[case.name]
    assert run["steps"] == [3, 4], run  # the resumed run trained only the steps after the checkpoint
    assert len(run["uninterrupted"]) == len(run["resumed"]) == 4, run  # the log history is restored
    tol = 0.0 if case.backend == "ddp" else 1e-6  # bit-exact on CPU for DDP
    for (loss, norm), (ref_loss, ref_norm) in zip(run["resumed"][2:], run["uninterrupted"][2:], strict=True):
        assert abs(loss - ref_loss) <= tol * abs(ref_loss), (case.name, run)
        assert abs(norm - ref_norm) <= tol * abs(ref_norm), (case.name, run)


@pytest.mark.unit
def test_cpu_fsdp_hybrid_sharding_is_refused_clearly():
    from types import SimpleNamespace

    from hf_sp_trainer.integrations.cpu_backend import _drop_fsdp_mesh

    args = SimpleNamespace(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    with pytest.raises(ValueError, match="dp_replicate_size=2"):
        _drop_fsdp_mesh(args)
    args = SimpleNamespace(parallelism_config=ParallelismConfig(dp_shard_size=4))
    _drop_fsdp_mesh(args)  # a 1-D mesh over every rank is FSDP2's default mesh
    assert args.parallelism_config is None
