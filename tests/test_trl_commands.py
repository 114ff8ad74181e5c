"""hf-sp-dpo / reward / kto / grpo / rloo accept every flag of the matching `trl <cmd>` plus the SP flags."""

import importlib

import pytest

from hf_sp_trainer.cli.trl_commands import COMMANDS, make_parser, reward_functions

pytestmark = pytest.mark.unit  # in-process


def _flags(parser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_trl_flag_and_the_sp_flags(command):
    trl_parser = importlib.import_module(f"trl.scripts.{command}").make_parser()
    ours = _flags(make_parser(command))
    assert _flags(trl_parser) <= ours
    assert {"--sp_size", "--sp_ring_size", "--sp_attn_implementation", "--tiled_mlp"} <= ours


def test_worker_parses_into_the_sp_config(tmp_path):
    from hf_sp_trainer import DPOConfig

    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path), "--use_cpu"]
    _, config, model_args, _ = make_parser("dpo").parse_args_and_config([*argv, "--beta", "0.3"])
    assert isinstance(config, DPOConfig) and config.beta == 0.3 and config.sp_size == 1
    assert model_args.model_name_or_path == "m"


def test_grpo_parses_reward_options_into_the_sp_config(tmp_path):
    from hf_sp_trainer import GRPOConfig

    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path), "--use_cpu"]
    script_args, config, _, _ = make_parser("grpo").parse_args_and_config(
        [*argv, "--reward_funcs", "think_format_reward", "tests.grpo_harness.reward_len_and_vowels", "--beta", "0.1"]
    )
    assert isinstance(config, GRPOConfig) and config.beta == 0.1 and config.sp_size == 1
    funcs = reward_functions(script_args)
    assert [f.__name__ for f in funcs] == ["think_format_reward", "reward_len_and_vowels"]


def test_unknown_or_missing_reward_functions_are_refused():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="Unknown reward function 'nope'"):
        reward_functions(SimpleNamespace(reward_model_name_or_path=None, reward_funcs=["nope"]))
    with pytest.raises(ValueError, match="--reward_funcs"):
        reward_functions(SimpleNamespace(reward_model_name_or_path=None, reward_funcs=None))
