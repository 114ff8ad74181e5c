"""``hf-sp-sft``: every ``trl sft`` flag is accepted, SP flags are documented, and a 2-process sp=2 LoRA run gives
the same per-step losses as the 1-process run (launched by hf-sp-sft itself, and in-process under torchrun)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.harness import EXACT, tiny_model
from tests.launches import free_port, port_flags, run_side_by_side
from tests.sft_harness import sft_dataset

pytestmark = pytest.mark.e2e  # launched jobs; the tests marked otherwise below are not

BIN = os.path.dirname(sys.executable)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _options(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", help_text))


@pytest.mark.unit
def test_help_accepts_every_trl_sft_option():
    """Every option of `trl sft --help` is in `hf-sp-sft --help`, with the SP flags and the launcher flags."""
    from trl.scripts.sft import make_parser as trl_parser

    from hf_sp_trainer.cli.args import make_parser

    trl_options, our_options = _options(trl_parser().format_help()), _options(make_parser().format_help())
    assert len(trl_options) > 100
    assert trl_options <= our_options, sorted(trl_options - our_options)
    for flag in ("--sp_size", "--sp_attn_implementation", "--num_processes"):
        assert flag in our_options


@pytest.mark.unit
def test_one_parser_for_launcher_and_workers():
    """The launcher splits the command line without building dataclasses (no world-size check in the launcher); the
    workers build them with the same parser: SP and memory-stack flags, launcher flags left over."""
    from hf_sp_trainer.cli.args import make_parser

    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--use_cpu", "--sp_size", "2",
            "--tiled_mlp", "--tiled_mlp_num_shards", "4", "--checkpoint_policy",
            "sequence_aware", "--checkpoint_offloading", "--num_processes", "2"]  # fmt: skip
    namespace, config_remaining, cli_remaining = make_parser().parse_namespace(argv)
    assert config_remaining == [] and cli_remaining == ["--num_processes", "2"]
    assert (namespace.sp_size, namespace.sp_ring_size, namespace.tiled_mlp) == (2, None, True)
    single = [*argv[:-2], "--sp_size", "1"]  # this process is a one-process run: SFTConfig checks sp vs world
    _, args, _, _ = make_parser().parse_args_and_config(single)
    assert (args.tiled_mlp, args.tiled_mlp_num_shards, args.checkpoint_policy) == (True, 4, "sequence_aware")
    assert args.checkpoint_offloading and args.sp_ring_size is None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from hf_sp_trainer.data import build_char_tokenizer

    root = tmp_path_factory.mktemp("cli")
    tiny_model("llama").save_pretrained(root / "model")
    build_char_tokenizer().save_pretrained(root / "model")
    sft_dataset("prompt_completion", 12, seed=3).to_json(str(root / "data.jsonl"))
    common = [
        "--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "data.jsonl"),
        "--use_peft", "--lora_r", "4", "--lora_dropout", "0", "--lora_target_modules", "q_proj", "v_proj",
        "--max_steps", "3", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--logging_steps", "1",
        "--report_to", "none", "--bf16", "false", "--save_strategy", "no", "--seed", "0",
        "--max_length", "40",  # truncates some documents: SP must truncate exactly as without it
    ]  # fmt: skip

    def run(name, *launchers, flags=()):
        """Run ``launchers`` (one per emulated node) concurrently with the common flags; return (loss, grad_norm).
        Every launch must exit 0: 2-rank runs tear their process groups down cleanly (barrier, then destroy)."""
        out = root / name
        procs = [
            subprocess.Popen(
                [*launcher, *common, "--output_dir", str(out), *flags],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=ENV,
            )  # fmt: skip
            for launcher in launchers
        ]
        for proc in procs:
            output = proc.communicate(timeout=600)[0]
            assert proc.returncode == 0, output[-4000:]
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        return [(e["loss"], e["grad_norm"]) for e in history if "grad_norm" in e]

    def runs(launches: dict[str, tuple[list[str], ...]]) -> list:
        """``run(name, *launchers)`` for every entry, side by side (``tests/launches.py``); the results in order."""
        done = run_side_by_side({name: lambda n=name, ls=ls: run(n, *ls) for name, ls in launches.items()})
        return list(done.values())

    run.side_by_side = runs
    return run


@pytest.fixture(scope="module")
def reference(tiny_run):
    return tiny_run("sp1", [f"{BIN}/hf-sp-sft", "--num_processes", "1"])


def assert_same_steps(got, reference):
    assert len(reference) == 3
    for (loss, norm), (ref_loss, ref_norm) in zip(got, reference, strict=True):
        assert abs(loss - ref_loss) <= EXACT * abs(ref_loss), (got, reference)
        assert abs(norm - ref_norm) <= EXACT * abs(ref_norm), (got, reference)


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """The built-in main job shortened to 3 steps, as launched with no arguments (2 processes, sp 2) and with
    ``--num_processes 1 --sp_size 1``: per sp, the console output and the logged per-step losses."""
    root = tmp_path_factory.mktemp("main_job")

    def launch(sp: int, flags: list[str]):
        out = root / f"sp{sp}"
        done = subprocess.run(
            [f"{BIN}/hf-sp-sft", "--max_steps", "3", "--logging_steps", "1", "--output_dir", str(out), *flags],
            capture_output=True, text=True, env=ENV, timeout=900, cwd=root,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        return done.stdout, [e["loss"] for e in history if "grad_norm" in e], out

    return run_side_by_side({
        2: lambda: launch(2, port_flags("accelerate")),  # the defaults: 2 processes, sp 2
        1: lambda: launch(1, ["--num_processes", "1", "--sp_size", "1"]),
    })  # fmt: skip


def test_main_job_runs_end_to_end(main_job):
    """Trains under sp_size 2, evaluates retrieval through SP and with attention restricted to each shard, and
    reports where the model is."""
    out, _, model_dir = main_job[2]
    assert "on 2 process(es) (sp_size=2)" in out
    assert re.search(r"retrieval accuracy on 40 held-out documents of 512-8192 tokens: [\d.]+%", out)
    assert re.search(r"cross-shard\): \d+/20", out) and re.search(r"in-shard\):  \d+/20", out)
    assert re.search(r"control, attention restricted to each rank's shard: cross-shard \d+/20", out)
    assert re.search(r"peak memory per rank: \d+ MB, \d+ MB", out)
    assert (model_dir / "model.safetensors").exists()
    assert out.count("Main job done") == 1  # one console: rank 0 reports


def test_main_job_same_flags_same_training_at_sp1_and_sp2(main_job):
    """The main job's defaults give the same per-step losses on one process and on 2 processes with sp 2."""
    (_, ref, _), (_, got, _) = main_job[1], main_job[2]
    assert len(ref) == 3
    for loss, ref_loss in zip(got, ref, strict=True):
        assert abs(loss - ref_loss) <= EXACT * abs(ref_loss), (got, ref)


def test_cli_lora_sp2_matches_one_process(tiny_run, reference):
    launched, torchrun = tiny_run.side_by_side({
        "sp2": ([f"{BIN}/hf-sp-sft", "--num_processes", "2", "--sp_size", "2", *port_flags("accelerate")],),
        "torchrun": ([f"{BIN}/torchrun", "--nproc_per_node", "2", *port_flags("torchrun"), f"{BIN}/hf-sp-sft",
                      "--sp_size", "2", "--use_cpu"],),
    })  # fmt: skip
    for got in (launched, torchrun):
        assert_same_steps(got, reference)


def test_cli_accelerate_routes(tiny_run, reference):
    """accelerate's own flags: FSDP2 with `--parallelism_config_sp_size 2`, and DeepSpeed ZeRO-3 with --sp_size 2."""
    fsdp, zero3 = tiny_run.side_by_side({
        "fsdp_pc": ([f"{BIN}/hf-sp-sft", "--num_processes", "2", "--use_fsdp", "--fsdp_version", "2",
                     "--use_parallelism_config", "--parallelism_config_sp_size", "2", *port_flags("accelerate")],),
        "zero3": ([f"{BIN}/hf-sp-sft", "--num_processes", "2", "--use_deepspeed", "--zero_stage", "3",
                   "--sp_size", "2", *port_flags("accelerate")],),
    })  # fmt: skip
    for got in (fsdp, zero3):
        assert_same_steps(got, reference)


def _nodes(port: int, launcher) -> list[list[str]]:
    return [launcher(rank, str(port)) for rank in (0, 1)]


def test_multinode_launchers_on_loopback(tiny_run, reference, tmp_path):
    """Two emulated nodes (one process each, rendezvous on 127.0.0.1) under torchrun, accelerate and the deepspeed
    launcher: sp_size 2 spans the nodes and reproduces the one-process run."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    torchrun, accelerate, deepspeed = tiny_run.side_by_side({
        "multinode_torchrun": _nodes(free_port(), lambda rank, port: [
            f"{BIN}/torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
            "--master_addr", "127.0.0.1", "--master_port", port, f"{BIN}/hf-sp-sft", "--sp_size", "2", "--use_cpu",
        ]),
        "multinode_accelerate": _nodes(free_port(), lambda rank, port: [
            f"{BIN}/hf-sp-sft", "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--sp_size", "2",
        ]),
        "multinode_deepspeed": _nodes(free_port(), lambda rank, port: [
            f"{BIN}/deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2", "--node_rank", str(rank),
            "--num_gpus", "1", "--master_addr", "127.0.0.1", "--master_port", port,
            f"{BIN}/hf-sp-sft", "--sp_size", "2", "--use_cpu",
        ]),
    })  # fmt: skip
    for got in (torchrun, accelerate, deepspeed):
        assert_same_steps(got, reference)
