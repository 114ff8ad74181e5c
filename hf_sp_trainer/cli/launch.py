"""``hf-sp-sft``: parse like ``trl sft``, then launch the workers (or run in-process when already launched).

Flags the training dataclasses don't know (``--num_processes``, ``--num_machines``, ``--machine_rank``,
``--main_process_ip``, ``--accelerate_config``, ...) go to ``accelerate launch``, as with ``trl sft``.
"""

from __future__ import annotations

import os
import sys

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


def _accelerate_launch(launch_args: list[str], script_args: list[str]) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    from . import sft

    launch_args = resolve_accelerate_config_argument(launch_args)
    if "--config_file" not in launch_args:  # accelerate's own defaults, stated (it warns about each one otherwise)
        given = {arg.split("=", 1)[0] for arg in launch_args}
        launch_args += [x for flag, value in _LAUNCH_DEFAULTS.items() if flag not in given for x in (flag, value)]
    num_processes = int(_flag_value(launch_args, "--num_processes") or 1)
    if num_processes > 1 and not any(flag in launch_args for flag in _MULTI_PROCESS_FLAGS):
        launch_args = ["--multi_gpu", *launch_args]  # accelerate's torchrun launcher; gloo on CPU-only machines
    parsed = launch_command_parser().parse_args([*launch_args, sft.__file__, *script_args])
    launch_command(parsed)


def _on_cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from . import main_job, sft
    from .args import make_parser

    if any(os.environ.get(name) for name in _LAUNCHED_ENV):  # started by torchrun / accelerate / deepspeed
        from ..topology.teardown import exit_finished_worker

        sft.worker(argv)
        exit_finished_worker()
    if _on_cpu_only():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed then says nothing about detecting no GPU
        if "--use_cpu" not in argv:
            argv.append("--use_cpu")  # else TrainingArguments refuses its bf16 default on a CPU-only machine
    namespace, config_remaining, cli_remaining = make_parser().parse_namespace(argv)
    launch_args = config_remaining + cli_remaining
    script_args = _subtract(argv, cli_remaining)
    if main_job.is_requested(namespace):
        script_args = main_job.default_argv(script_args)
        launch_args = main_job.default_launch_args(launch_args)
    _accelerate_launch(launch_args, script_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
