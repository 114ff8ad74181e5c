"""The one argument parser of ``hf-sp-sft``, for the launcher and the workers alike.

TRL's own parser over TRL's dataclasses with our ``SFTConfig`` (``trl.SFTConfig`` + the SP and memory-stack fields),
so every ``trl sft`` flag and YAML key works unchanged. The launcher only splits the command line
(``parse_namespace``: argparse, no dataclass is built, since ``SFTConfig`` checks ``sp_size`` against the world size
of the launched run); the workers build the dataclasses.
"""

from __future__ import annotations

import argparse

EPILOG = """
launcher flags (passed to `accelerate launch`, as with `trl sft`):
  --num_processes N        processes to start (world size = dp x sp); --accelerate_config NAME|FILE
  --num_machines, --machine_rank, --main_process_ip, --main_process_port   multi-node launches
Without model and dataset arguments, hf-sp-sft runs its built-in main job: a small Llama trained on synthetic
retrieval documents on CPU with 2 processes and sp_size 2.
"""


def sp_size_flag(value: str) -> int | str:
    """``--sp_size``: a positive integer or ``auto`` (resolved by the trainer in each worker, not by the launcher)."""
    from ..trainers.auto_sp import parse_sp_size

    try:
        return parse_sp_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def make_parser(prog: str = "hf-sp-sft", config_cls: type | None = None, script_args_cls: type | None = None):
    """``config_cls``: the training config (default ``SFTConfig``; the other TRL commands pass theirs);
    ``script_args_cls``: the script arguments (default TRL's ``ScriptArguments``; GRPO / RLOO add reward options)."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    from ..trainers.sft import SFTConfig

    config_cls = config_cls or SFTConfig

    class Parser(TrlParser):
        _namespace_only = False

        def parse_namespace(self, argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
            """``(namespace, config_remaining, cli_remaining)``: the flags as parsed, and those no dataclass knows
            (launcher flags) from the YAML config and from the command line. Builds no dataclass."""
            self._namespace_only = True
            try:
                return self.parse_args_and_config(argv, return_remaining_strings=True, separate_remaining_strings=True)
            finally:
                self._namespace_only = False

        def parse_args_into_dataclasses(self, args=None, return_remaining_strings=False, **kwargs):
            if self._namespace_only:
                return self.parse_known_args(args)
            return super().parse_args_into_dataclasses(args, return_remaining_strings, **kwargs)

    parser = Parser((script_args_cls or ScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig), prog=prog)
    for action in parser._actions:  # HfArgumentParser types `int | str` as int: `--sp_size auto` must parse
        if action.dest == "sp_size":
            action.type = sp_size_flag
    parser.epilog = EPILOG
    parser.formatter_class = _HelpFormatter
    return parser
