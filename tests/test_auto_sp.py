"""``sp_size="auto"``: the planner's choice (three model sizes x three lengths, the refusal), the argument's
validation in the configs and on the command line, the longest row, and the trainers resolving it (one process: sp 1;
two processes with a budget that only sp 2 fits)."""

import importlib.util
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import transformers

from hf_sp_trainer import SPTrainer, TrainingArguments
from hf_sp_trainer.planner import GIB, Setting, estimate
from hf_sp_trainer.planner.auto import choose_sp, model_shape
from hf_sp_trainer.trainers.auto_sp import longest_row, parse_sp_size
from tests.harness import CHECKPOINTING_ARG, run_distributed, synthetic_dataset, tiny_model, unwrap_results

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

# The model shapes scripts/plan_auto_sp.py reports on (the closing figures): the same dicts here
_SCRIPT = Path(__file__).parents[1] / "scripts" / "plan_auto_sp.py"
_spec = importlib.util.spec_from_file_location("plan_auto_sp", _SCRIPT)
plan_auto_sp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_auto_sp)
LLAMA_8B, QWEN3_32B, LLAMA_70B = plan_auto_sp.LLAMA_8B, plan_auto_sp.QWEN3_32B, plan_auto_sp.LLAMA_70B
K = 1024
# model -> (config, LoRA, the sp chosen at 32K, 128K, 512K on 8 x 80 GiB; None: refused), ZeRO-3 + the memory stack
CHOICES = {
    "llama-8b": (transformers.LlamaConfig(**LLAMA_8B), False, (1, 1, 4)),
    "qwen3-32b": (transformers.Qwen3Config(**QWEN3_32B), True, (1, 2, 8)),
    "llama-70b": (transformers.LlamaConfig(**LLAMA_70B), True, (1, 4, None)),
}


def _quiet(tmp, **fields) -> dict:
    return dict(output_dir=str(tmp), max_steps=2, logging_steps=1, report_to="none", disable_tqdm=True, use_cpu=True,
                save_strategy="no", per_device_train_batch_size=2, **fields)  # fmt: skip


@pytest.mark.parametrize("name", list(CHOICES))
def test_choice_three_models_three_lengths(name):
    """The smallest sp dividing 8 whose predicted peak fits 80 GiB (every smaller one does not), split as the
    trainers split it; nothing fitting is a ValueError naming the row, the budget, the world, the best and a fix."""
    config, lora, expected = CHOICES[name]
    shape = model_shape(config, name)
    setting = Setting(gpus=8, sp=1, zero=3, lora=lora, tiled_mlp=True, fused_loss=True)
    budget = 80 * GIB
    for length, sp in zip((32 * K, 128 * K, 512 * K), expected, strict=True):
        if sp is None:
            with pytest.raises(ValueError) as refused:
                choose_sp(shape, length, budget, 8, setting)
            message = str(refused.value)
            parts = ("524,288-token rows", "80.00 GiB per rank", "on 8 rank(s)", "the best, sp 8 (ulysses 8 x ring 1), "
                     "needs", "the longest row that fits is", "with checkpoint_offloading=True it fits")  # fmt: skip
            assert all(part in message for part in parts), message
            continue
        plan = choose_sp(shape, length, budget, 8, setting)
        assert (plan.sp, plan.length, plan.world_size) == (sp, length, 8)
        assert plan.ulysses * plan.ring == sp and plan.ring == 1  # 32 / 64 heads: Ulysses alone up to 8
        assert plan.peak == estimate(shape, replace(setting, sp=sp), length).peak <= budget
        assert list(plan.peaks) == [d for d in (1, 2, 4, 8) if d <= sp]
        assert all(peak > budget for s, peak in plan.peaks.items() if s < sp)


def test_choice_splits_with_a_ring_and_on_cpu():
    """Heads that don't divide sp take a ring (split_sp_size's default); device='cpu' budgets a CPU process."""
    shape = model_shape(transformers.LlamaConfig(**{**LLAMA_8B, "num_attention_heads": 2, "num_key_value_heads": 2}))
    tight = estimate(shape, Setting(gpus=4, sp=4), 64 * K).peak
    plan = choose_sp(shape, 64 * K, tight, 4, Setting(gpus=1, sp=1))
    assert (plan.sp, plan.ulysses, plan.ring) == (4, 2, 2)
    tiny = model_shape(tiny_model("llama").config)
    assert choose_sp(tiny, 64, 8 * GIB, 1, Setting(gpus=1, sp=1, dtype="fp32", device="cpu")).sp == 1
    with pytest.raises(ValueError, match="must be > 0"):
        choose_sp(tiny, 0, GIB, 1)


def test_refusal_without_the_memory_stack_names_the_features_that_fit():
    shape = model_shape(transformers.LlamaConfig(**LLAMA_8B), "llama-8b")
    fits = r"At sp 8 .* 59,392 tokens; with activation_checkpointing=True \(gradient_checkpointing before transformers "
    with pytest.raises(ValueError, match=fits + r"5\.24\), fused_loss=True it fits at sp 8 \("):
        choose_sp(shape, 512 * K, 80 * GIB, 8, Setting(gpus=8, sp=1, zero=3, checkpointing="none"))
    everything = Setting(gpus=8, sp=1, tiled_mlp=True, fused_loss=True, offload=True, zero=3, dtype="fp32")
    none_fits = "the best, sp 8 .* not even a 1,024-token row fits; more GPUs .*, LoRA or shorter"
    with pytest.raises(ValueError, match=none_fits):  # 70B, full fine-tuning in fp32
        choose_sp(model_shape(transformers.LlamaConfig(**LLAMA_70B)), 4 * K, 80 * GIB, 8, everything)


def test_sp_size_values():
    assert [parse_sp_size(v) for v in ("auto", 1, 8, "4", " 2 ")] == ["auto", 1, 8, 4, 2]
    for bad in (0, -2, "0", "Auto", "max", "", 2.0, True, None):
        with pytest.raises(ValueError, match="positive integer .* or 'auto'"):
            parse_sp_size(bad)


def test_arguments_accept_auto_and_refuse_the_rest(tmp_path):
    from hf_sp_trainer import DPOConfig, GRPOConfig, SFTConfig

    assert TrainingArguments(**_quiet(tmp_path, sp_size="auto")).sp_size == "auto"  # resolved by the trainer
    assert SFTConfig(**_quiet(tmp_path, sp_size="auto")).sp_size == "auto"
    for bad in (0, "eight"):
        with pytest.raises(ValueError, match="positive integer"):
            TrainingArguments(**_quiet(tmp_path, sp_size=bad))
    with pytest.raises(ValueError, match="sp_ring_size=2 with sp_size='auto'"):
        TrainingArguments(**_quiet(tmp_path, sp_size="auto", sp_ring_size=2))
    with pytest.raises(ValueError, match="not available for GRPOConfig"):
        GRPOConfig(**_quiet(tmp_path, sp_size="auto"))
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):  # auto may pick sp > 1
        DPOConfig(**_quiet(tmp_path, sp_size="auto", precompute_ref_log_probs=True))


def test_cli_parses_sp_size_auto():
    """`--sp_size auto` passes the launcher's parse and reaches the config as "auto"; a bad value is argparse's
    error."""
    from hf_sp_trainer.cli.args import make_parser

    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--use_cpu", "--sp_size", "auto"]
    namespace, _, cli_remaining = make_parser().parse_namespace([*argv, "--num_processes", "4"])
    assert namespace.sp_size == "auto" and cli_remaining == ["--num_processes", "4"]
    _, args, _, _ = make_parser().parse_args_and_config(argv)
    assert args.sp_size == "auto"
    assert make_parser().parse_namespace([*argv[:-1], "3"])[0].sp_size == 3
    with pytest.raises(SystemExit):
        make_parser().parse_namespace([*argv[:-1], "most"])


def test_longest_row(tmp_path):
    import datasets

    from hf_sp_trainer import SFTConfig

    rows = synthetic_dataset(6, seed=1)
    top2 = sum(sorted(len(r["input_ids"]) for r in rows)[-2:])
    args = TrainingArguments(**_quiet(tmp_path))
    assert longest_row(args, rows) == top2  # the collator packs a batch of 2 into one row
    assert longest_row(args, datasets.Dataset.from_list(rows)) == top2
    assert longest_row(args, rows, rows_per_example=2) == sum(sorted(len(r["input_ids"]) for r in rows)[-4:])
    assert longest_row(SFTConfig(**_quiet(tmp_path, max_length=300)), rows) == 600  # max_length first
    untokenized = datasets.Dataset.from_list([{"text": "a b c"}])
    with pytest.raises(ValueError, match="set max_length"):
        longest_row(SFTConfig(**_quiet(tmp_path, max_length=None)), untokenized)
    with pytest.raises(ValueError, match="pass a tokenized datasets.Dataset"):
        longest_row(args, untokenized.to_iterable_dataset())


def test_trainer_resolves_auto_to_1_and_trains(tmp_path, caplog):
    """One CPU process: sp 1 (the only divisor), logged with its predicted peak; the run is the sp_size=1 run."""
    rows = synthetic_dataset(4, seed=7)
    args = TrainingArguments(**_quiet(tmp_path, sp_size="auto"))
    with caplog.at_level(logging.INFO, logger="hf_sp_trainer.trainers.auto_sp"):
        trainer = SPTrainer(model=tiny_model("llama"), args=args, train_dataset=rows)
    assert trainer.args.sp_size == 1 and trainer.sp is None
    assert (trainer.sp_plan.sp, trainer.sp_plan.ulysses, trainer.sp_plan.ring) == (1, 1, 1)
    assert trainer.sp_plan.length == sum(sorted(len(r["input_ids"]) for r in rows)[-2:])
    assert "sp_size='auto': sp_size=1 (ulysses 1 x ring 1, dp 1)" in caplog.text and "predicted peak" in caplog.text
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    plain = SPTrainer(model=tiny_model("llama"), args=TrainingArguments(**_quiet(tmp_path / "1")), train_dataset=rows)
    plain.train()
    assert losses == [e["loss"] for e in plain.state.log_history if "loss" in e] and len(losses) == 2


def test_trainer_refuses_what_does_not_fit(tmp_path):
    args = TrainingArguments(**_quiet(tmp_path, sp_size="auto", checkpoint_memory_budget=100e6))
    with pytest.raises(ValueError, match=r"does not fit \d+-token rows in 0.09 GiB per rank on 1 rank"):
        SPTrainer(model=tiny_model("llama"), args=args, train_dataset=synthetic_dataset(4))


def _auto_on_two_ranks(out_dir: str) -> dict:
    """Each rank: auto with the measured budget (host memory, the least over the ranks: sp 1), then with a budget
    between the predicted peaks of sp 1 and sp 2 (sp 2), which trains."""
    rows = synthetic_dataset(8, seed=3)
    measured = SPTrainer(model=tiny_model("llama"), args=TrainingArguments(**_quiet(out_dir, sp_size="auto",
                         ddp_backend="gloo")), train_dataset=rows)  # fmt: skip
    peaks = measured.sp_plan.peaks
    shape, length = model_shape(measured.model.config), measured.sp_plan.length
    setting = Setting(gpus=2, sp=2, checkpointing="none", dtype="fp32", device="cpu")  # what the arguments say
    between = (peaks[1] + estimate(shape, setting, length).peak) / 2
    args = TrainingArguments(**_quiet(out_dir, sp_size="auto", checkpoint_memory_budget=between, ddp_backend="gloo"))
    trainer = SPTrainer(model=tiny_model("llama"), args=args, train_dataset=rows)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"measured": (measured.args.sp_size, peaks, measured.sp_plan.budget), "planned": trainer.sp_plan,
            "sp": trainer.sp.topology.sp_size, "losses": losses,
            "expected_peak": estimate(shape, replace(setting, sp=1), length).peak}  # fmt: skip


@pytest.mark.dist
def test_auto_picks_sp2_on_two_ranks(tmp_path):
    ranks = unwrap_results(run_distributed(2, _auto_on_two_ranks, str(tmp_path)))
    assert ranks[0]["measured"] == ranks[1]["measured"]  # the same budget (the least) and choice on every rank
    sp, peaks, _ = ranks[0]["measured"]
    assert sp == 1 and peaks[1] == ranks[0]["expected_peak"]  # the setting read from the arguments
    for rank in ranks:
        assert rank["planned"] == ranks[0]["planned"] and rank["planned"].sp == rank["sp"] == 2
        assert len(rank["losses"]) == 2 and rank["losses"] == ranks[0]["losses"]


def test_memory_budget(monkeypatch):
    """checkpoint_memory_budget first; else the CUDA device's memory; else host memory over the local processes."""
    import types

    import torch

    from hf_sp_trainer.trainers import auto_sp

    cpu = types.SimpleNamespace(device=torch.device("cpu"), world_size=4, checkpoint_memory_budget=None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert auto_sp.memory_budget(cpu) == (auto_sp.host_memory() / 2, "host memory over 2 local process(es)")
    assert 0 < auto_sp.host_memory() < 1 << 50
    assert auto_sp.memory_budget(replace_ns(cpu, checkpoint_memory_budget=3e9)) == (3e9, "checkpoint_memory_budget")
    with pytest.raises(ValueError, match="only CUDA devices have"):
        auto_sp.memory_budget(replace_ns(cpu, checkpoint_memory_budget=0.9))
    props = types.SimpleNamespace(total_memory=80 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = replace_ns(cpu, device=torch.device("cuda", 0))
    assert auto_sp.memory_budget(cuda) == (80 * GIB, "the CUDA device's memory")
    assert auto_sp.memory_budget(replace_ns(cuda, checkpoint_memory_budget=0.5))[0] == 40 * GIB


def replace_ns(ns, **fields):
    import types

    return types.SimpleNamespace(**{**vars(ns), **fields})


def test_setting_from_the_arguments(tmp_path):
    """The planner's setting of a trainer's arguments: the memory stack, LoRA, a TRL reference copy, the ZeRO stage."""
    import inspect
    import types

    import trl
    from peft import LoraConfig

    from hf_sp_trainer.trainers.auto_sp import _zero_stage, setting_from_args

    model = tiny_model("llama")
    args = TrainingArguments(**_quiet(tmp_path, **{CHECKPOINTING_ARG: True}, tiled_mlp=True,
                                      checkpoint_policy="sequence_aware"))  # fmt: skip
    sp_trainer = types.SimpleNamespace(sp_fuses_lm_loss=False)
    bound = inspect.signature(transformers.Trainer.__init__).bind(None, model=model, args=args)
    s = setting_from_args(sp_trainer, bound)
    assert (s.gpus, s.checkpointing, s.tiled_mlp, s.fused_loss, s.lora, s.zero) == (1, "sequence_aware", True, False,
                                                                                    False, 0)  # fmt: skip
    assert (s.dtype, s.device, s.reference_model, s.offload) == ("fp32", "cpu", False, False)
    dpo = inspect.signature(trl.DPOTrainer.__init__)
    assert setting_from_args(sp_trainer, dpo.bind(None, model=model, args=args)).reference_model  # TRL copies it
    lora = setting_from_args(sp_trainer, dpo.bind(None, model=model, args=args, peft_config=LoraConfig(r=8)))
    assert (lora.lora, lora.lora_r, lora.reference_model) == (True, 8, False)
    assert setting_from_args(types.SimpleNamespace(sp_fuses_lm_loss=True), bound).fused_loss  # TRL's fused head
    ns = types.SimpleNamespace
    assert _zero_stage(ns(hf_deepspeed_config=ns(get_value=lambda key, default: 2))) == 2
    fsdp = (["full_shard"], ["shard_grad_op"], [])
    assert [_zero_stage(ns(fsdp=f, parallelism_config=None)) for f in fsdp] == [3, 2, 0]
    assert _zero_stage(ns(fsdp=[], parallelism_config=ns(dp_shard_size=4))) == 3
