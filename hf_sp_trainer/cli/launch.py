"""``hf-sp-sft``: parse like ``trl sft``, then launch the workers (or run in-process when already launched).

Flags the training dataclasses don't know (``--num_processes``, ``--num_machines``, ``--machine_rank``,
``--main_process_ip``, ``--accelerate_config``, ...) go to ``accelerate launch``, as with ``trl sft``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from . import main_job

# Set by torchrun, `accelerate launch` and the deepspeed launcher in every worker.
_LAUNCHED_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE")
# `accelerate launch` needs one of these to start more than one process.
_MULTI_PROCESS_FLAGS = ("--multi_gpu", "--use_deepspeed", "--use_fsdp", "--config_file", "--tpu", "--use_mps_device")

EPILOG = """
launcher flags (passed to `accelerate launch`, as with `trl sft`):
  --num_processes N        processes to start (world size = dp x sp); --accelerate_config NAME|FILE
  --num_machines, --machine_rank, --main_process_ip, --main_process_port   multi-node launches
Without model and dataset arguments, hf-sp-sft runs its built-in main job: a small Llama trained on synthetic
passkey-retrieval documents on CPU with 2 processes and sp_size 2.
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _subtract(argv: list[str], subsequence: list[str]) -> list[str]:
    """``argv`` without the ordered ``subsequence`` (the launcher's flags)."""
    rest, it = [], iter(subsequence)
    current = next(it, None)
    for item in argv:
        if current is not None and item == current:
            current = next(it, None)
        else:
            rest.append(item)
    return rest


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _accelerate_launch(launch_args: list[str], script_args: list[str]) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    from . import sft

    launch_args = resolve_accelerate_config_argument(launch_args)
    num_processes = int(_flag_value(launch_args, "--num_processes") or 1)
    if num_processes > 1 and not any(flag in launch_args for flag in _MULTI_PROCESS_FLAGS):
        launch_args = ["--multi_gpu", *launch_args]  # accelerate's torchrun launcher; gloo on CPU-only machines
    parsed = launch_command_parser().parse_args([*launch_args, sft.__file__, *script_args])
    launch_command(parsed)


def _on_cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def make_launcher_parser():
    """TRL's parser over TRL's dataclasses plus the SP flags; nothing is validated against a world size here."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

    from ..arguments import SequenceParallelArguments
    from ..memory import MemoryArguments

    trl_fields = {f.name for f in dataclasses.fields(SFTConfig)}  # TRL has `activation_offloading` already
    memory = dataclasses.make_dataclass(
        "MemoryArguments",
        [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
         for f in dataclasses.fields(MemoryArguments) if f.name not in trl_fields],
    )  # fmt: skip
    dataclass_types = (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig, SequenceParallelArguments, memory)
    parser = TrlParser(dataclass_types, prog="hf-sp-sft")
    parser.epilog = EPILOG
    parser.formatter_class = _HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from . import sft

    if any(os.environ.get(name) for name in _LAUNCHED_ENV):  # started by torchrun / accelerate / deepspeed
        sft.worker(argv)
        return 0
    if _on_cpu_only() and "--use_cpu" not in argv:
        argv.append("--use_cpu")  # else TrainingArguments refuses its bf16 default on a CPU-only machine
    script, _, model, data, *_, config_remaining, cli_remaining = make_launcher_parser().parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    launch_args = config_remaining + cli_remaining
    script_args = _subtract(argv, cli_remaining)
    if main_job.is_requested(script, model, data):
        script_args = main_job.default_argv(script_args)
        launch_args = main_job.default_launch_args(launch_args)
    _accelerate_launch(launch_args, script_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
