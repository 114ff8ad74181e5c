"""``hf-sp-sft``: parse like ``trl sft``, then launch the workers (or run in-process when already launched).

Flags the training dataclasses don't know (``--num_processes``, ``--num_machines``, ``--machine_rank``,
``--main_process_ip``, ``--accelerate_config``, ...) go to ``accelerate launch``, as with ``trl sft``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# Set by torchrun, `accelerate launch` and the deepspeed launcher in every worker.
_LAUNCHED_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE")
# `accelerate launch` needs one of these to start more than one process.
_LAUNCH_DEFAULTS = {"--num_machines": "1", "--mixed_precision": "no", "--dynamo_backend": "no"}
_MULTI_PROCESS_FLAGS = ("--multi_gpu", "--use_deepspeed", "--use_fsdp", "--config_file", "--tpu", "--use_mps_device")


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


def launched() -> bool:
    """This process is a worker started by torchrun, ``accelerate launch`` or the deepspeed launcher."""
    return any(os.environ.get(name) for name in _LAUNCHED_ENV)


def accelerate_launch(launch_args: list[str], script: str, script_args: list[str]) -> None:
    """``accelerate launch <launch_args> <script> <script_args>``, with accelerate's defaults stated (it warns about
    each one otherwise) and its torchrun launcher for more than one process (gloo on CPU-only machines)."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    launch_args = resolve_accelerate_config_argument(launch_args)
    if "--config_file" not in launch_args:
        given = {arg.split("=", 1)[0] for arg in launch_args}
        launch_args += [x for flag, value in _LAUNCH_DEFAULTS.items() if flag not in given for x in (flag, value)]
    num_processes = int(_flag_value(launch_args, "--num_processes") or 1)
    if num_processes > 1 and not any(flag in launch_args for flag in _MULTI_PROCESS_FLAGS):
        launch_args = ["--multi_gpu", *launch_args]
    launch_command(launch_command_parser().parse_args([*launch_args, script, *script_args]))


def train_or_launch(argv: list[str], parser, worker: Callable[[list[str]], None], script: str, **options) -> int:
    """The entry point of every command: in a launched worker, ``worker(argv)`` trains and the process exits;
    otherwise ``argv`` is parsed with ``parser`` (a TRL-style parser) and its launcher flags start the workers,
    ``accelerate launch <launcher flags> <script> [prefix] <the training flags>``. ``options``: ``prefix`` (script
    arguments before the flags), ``defaults`` (``(namespace, script_args, launch_args) -> (script_args,
    launch_args)``: the main job's)."""
    if launched():
        from ..topology.teardown import exit_finished_worker

        worker(argv)
        exit_finished_worker()
    if _on_cpu_only():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed then says nothing about detecting no GPU
        if "--use_cpu" not in argv:
            argv.append("--use_cpu")  # else TrainingArguments refuses its bf16 default on a CPU-only machine
    namespace, config_remaining, cli_remaining = parser.parse_namespace(argv)
    launch_args = config_remaining + cli_remaining
    script_args = _subtract(argv, cli_remaining)
    if options.get("defaults") is not None:
        script_args, launch_args = options["defaults"](namespace, script_args, launch_args)
    accelerate_launch(launch_args, script, [*options.get("prefix", ()), *script_args])
    return 0


def _on_cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def _main_job_defaults(namespace, script_args: list[str], launch_args: list[str]) -> tuple[list[str], list[str]]:
    from . import main_job

    if main_job.is_requested(namespace):
        return main_job.default_argv(script_args), main_job.default_launch_args(launch_args)
    return script_args, launch_args


def main(argv: list[str] | None = None) -> int:
    from . import sft
    from .args import make_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    return train_or_launch(argv, make_parser(), sft.worker, sft.__file__, defaults=_main_job_defaults)


if __name__ == "__main__":
    raise SystemExit(main())
