"""GRPO / RLOO cases: the same run with single-process TRL and with the SP trainers (greedy generation, fp32)."""

from __future__ import annotations

import functools
import random
import string
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tests.harness import quiet_args, reset_backend_state, tiny_model

SKIPPED = ("epoch", "step", "tokens_per_second_per_rank", "step_time_s", "peak_memory_mb", "mfu", "step_time")


@dataclass(frozen=True)
class RLCase:
    name: str
    trainer: str = "grpo"  # grpo | rloo
    sp_size: int = 2
    world_size: int = 2
    prompts_per_step: int = 2
    num_generations: int = 2
    steps: int = 2
    config: dict = field(default_factory=dict)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def train(self, sp: bool, out_dir: str) -> dict:
        return train_rl_case(self, sp, out_dir)


def rl_dataset(n: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.randint(2, 8)  # prompts of different lengths: left padding
        rows.append({"prompt": " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(3)) for _ in range(words))})
    return Dataset.from_list(rows)


def reward_len_and_vowels(completions, **kwargs):
    """Deterministic: a function of the completion text only."""
    return [float(len(c)) / 8.0 + sum(ch in "aeiou" for ch in c) for c in completions]


def train_rl_case(case: RLCase, sp: bool, out_dir: str) -> dict:
    import trl

    import hf_sp_trainer as hst
    from hf_sp_trainer.data import build_char_tokenizer

    reset_backend_state()
    kind = {"grpo": ("GRPOConfig", "GRPOTrainer"), "rloo": ("RLOOConfig", "RLOOTrainer")}[case.trainer]
    config_cls, trainer_cls = (getattr(hst, kind[0]), getattr(hst, "SP" + kind[1])) if sp else (
        getattr(trl, kind[0]),
        getattr(trl, kind[1]),
    )
    per_device = case.prompts_per_step * case.num_generations // (case.dp_size if sp else 1)
    common = quiet_args(out_dir, case.steps) | dict(
        learning_rate=1e-3,
        per_device_train_batch_size=per_device,
        num_generations=case.num_generations,
        max_completion_length=12,
        generation_kwargs={"do_sample": False},
        bf16=False,
        beta=0.0,  # TODO: beta > 0 needs the policy as a saved path (TRL loads the reference from it)
        shuffle_dataset=False,
    )
    common |= case.config
    if sp:
        common |= dict(sp_size=case.sp_size, ddp_backend="gloo")
    model = tiny_model("llama")
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward_len_and_vowels,
        args=config_cls(**common),
        train_dataset=rl_dataset(case.prompts_per_step * case.steps * 2, seed=31),
        processing_class=build_char_tokenizer(),
    )
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    rank0 = not sp or dist.get_rank() == 0
    params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return {
        "losses": [e["loss"] for e in logs],
        "grad_norms": [e["grad_norm"] for e in logs],
        "logs": [{k: v for k, v in e.items() if k not in SKIPPED} for e in logs],
        "global_step": trainer.state.global_step,
        "params": params if rank0 else None,
        "init": None,
    }


CASES = [RLCase("grpo_sp2"), RLCase("rloo_sp2", trainer="rloo")]
TOL = 1e-5


@functools.cache
def sp_results(world_size: int) -> dict[str, dict]:
    from tests.harness import run_cases, run_distributed, unwrap_results

    return unwrap_results(run_distributed(world_size, run_cases, [c for c in CASES if c.world_size == world_size]))[0]
