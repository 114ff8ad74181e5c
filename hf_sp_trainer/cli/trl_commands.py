"""``hf-sp-dpo|reward|kto|grpo|rloo``: ``trl dpo|reward|kto|grpo|rloo`` with sequence parallelism.

Each accepts every flag (and YAML key) of the matching ``trl <cmd>`` plus the SP and memory-stack flags (GRPO / RLOO
also take ``--reward_funcs`` and ``--reward_model_name_or_path`` as TRL does), and launches like ``hf-sp-sft``: flags
no dataclass knows (``--num_processes``, ``--accelerate_config``, ...) go to ``accelerate launch``, which starts this
module in every worker.
"""

from __future__ import annotations

# Absolute imports only: `accelerate launch` runs this file as a script in every worker.
import functools
import os
import sys

# command -> (module, config, trainer)
COMMANDS = {
    "dpo": ("hf_sp_trainer.trainers.dpo", "DPOConfig", "SPDPOTrainer"),
    "reward": ("hf_sp_trainer.trainers.reward", "RewardConfig", "SPRewardTrainer"),
    "kto": ("hf_sp_trainer.trainers.kto", "KTOConfig", "SPKTOTrainer"),
    "grpo": ("hf_sp_trainer.trainers.grpo", "GRPOConfig", "SPGRPOTrainer"),
    "rloo": ("hf_sp_trainer.trainers.grpo", "RLOOConfig", "SPRLOOTrainer"),
}
ONLINE = ("grpo", "rloo")  # generate and reward: TRL's script arguments add the reward functions / model


def _classes(command: str):
    import importlib

    module, config, trainer = COMMANDS[command]
    module = importlib.import_module(module)
    return getattr(module, config), getattr(module, trainer)


def make_parser(command: str):
    from hf_sp_trainer.cli.args import make_parser as make_trl_parser

    script_args_cls = None
    if command in ONLINE:
        import importlib

        script_args_cls = getattr(
            importlib.import_module(f"trl.scripts.{command}"), f"{command.upper()}ScriptArguments"
        )
    parser = make_trl_parser(prog=f"hf-sp-{command}", config_cls=_classes(command)[0], script_args_cls=script_args_cls)
    parser.epilog = (
        f"\nlauncher flags (passed to `accelerate launch`, as with `trl {command}`):\n"
        "  --num_processes N        processes to start (world size = dp x sp); --accelerate_config NAME|FILE\n"
    )
    return parser


def worker(command: str, argv: list[str]) -> None:
    from hf_sp_trainer.cli.sft import quiet_other_ranks, train

    quiet_other_ranks()
    script_args, training_args, model_args, dataset_args = make_parser(command).parse_args_and_config(
        argv, fail_with_unknown_args=False
    )[:4]
    if not dataset_args.datasets and not script_args.dataset_name:
        raise ValueError(f"hf-sp-{command} needs --dataset_name (or `datasets` in a YAML config).")
    extra = {"reward_funcs": reward_functions(script_args)} if command in ONLINE else {}
    train(script_args, training_args, model_args, dataset_args, trainer_cls=_classes(command)[1], **extra)


def reward_functions(script_args) -> list:
    """``--reward_model_name_or_path`` and ``--reward_funcs`` resolved as ``trl grpo`` / ``trl rloo`` do: TRL's
    built-in names or a dotted import path (looked up from the working directory too)."""
    import importlib

    from trl import rewards

    builtin = {
        "accuracy_reward": lambda: rewards.accuracy_reward,
        "reasoning_accuracy_reward": lambda: rewards.reasoning_accuracy_reward,
        "think_format_reward": lambda: rewards.think_format_reward,
        "get_soft_overlong_punishment": lambda: rewards.get_soft_overlong_punishment(
            max_completion_len=1280, soft_punish_cache=256
        ),
    }
    funcs: list = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in script_args.reward_funcs or []:
        if name in builtin:
            funcs.append(builtin[name]())
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            funcs.append(getattr(importlib.import_module(module), attr))
        else:
            raise ValueError(f"Unknown reward function {name!r}: use one of {sorted(builtin)} or a dotted import path.")
    if not funcs:
        raise ValueError("Give --reward_funcs and/or --reward_model_name_or_path (as with `trl grpo` / `trl rloo`).")
    return funcs


def launch(command: str, argv: list[str] | None = None) -> int:
    """Parse like ``trl <command>``, then start the workers with ``accelerate launch`` (or train in-process when
    already launched by torchrun / accelerate / deepspeed)."""
    from hf_sp_trainer.cli.launch import train_or_launch

    argv = list(sys.argv[1:] if argv is None else argv)
    return train_or_launch(argv, make_parser(command), functools.partial(worker, command), __file__, prefix=[command])


def main_dpo() -> int:
    return launch("dpo")


def main_reward() -> int:
    return launch("reward")


def main_kto() -> int:
    return launch("kto")


def main_grpo() -> int:
    return launch("grpo")


def main_rloo() -> int:
    return launch("rloo")


if __name__ == "__main__":  # `python -m hf_sp_trainer.cli.trl_commands <command> <flags>`: launcher and workers
    raise SystemExit(launch(sys.argv[1], sys.argv[2:]))
