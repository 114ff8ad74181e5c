"""SFT cases: the same run with single-process ``trl.SFTTrainer`` and with ``SPSFTTrainer``."""

from __future__ import annotations

import dataclasses
import random
import string
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tests.harness import PADDED_REFERENCE, quiet_args, reset_backend_state, tiny_model


@dataclass(frozen=True)
class SFTCase:
    name: str
    data: str = "text"  # text | prompt_completion | messages
    sp_size: int = 2
    world_size: int = 2
    batch_size: int = 3
    steps: int = 3
    config: dict = field(default_factory=dict)  # extra SFTConfig fields for both runs
    lora: bool = False
    n_train: int = 0  # 0: exactly enough for `steps` optimizer steps
    family: str = "llama"
    model_overrides: dict = field(default_factory=dict)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def train(self, sp: bool, out_dir: str) -> dict:
        return train_sft_case(self, sp, out_dir)


def _words(rng, n):
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6))) for _ in range(n))


def sft_dataset(kind: str, n: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, answer = _words(rng, rng.randint(3, 12)), _words(rng, rng.randint(1, 4))
        if kind == "text":
            rows.append({"text": prompt + " " + answer})
        elif kind == "prompt_completion":
            rows.append({"prompt": prompt + " ->", "completion": " " + answer})
        else:
            rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return Dataset.from_list(rows)


def train_sft_case(case: SFTCase, sp: bool, out_dir: str, ddp: bool = False) -> dict:
    import peft
    import trl

    from hf_sp_trainer import SFTConfig, SPSFTTrainer
    from hf_sp_trainer.data import build_char_tokenizer

    reset_backend_state()
    tokenizer = build_char_tokenizer()
    model = tiny_model(case.family, **case.model_overrides)
    global_batch = case.batch_size * case.dp_size
    train = sft_dataset(case.data, case.n_train or global_batch * case.steps, seed=11)
    evals = sft_dataset(case.data, 4, seed=12)
    common = (
        quiet_args(out_dir, case.steps)
        | dict(
            per_device_eval_batch_size=2,
            learning_rate=1e-3,
            padding_free=True,
            max_length=None,
            dataset_num_proc=None,
            bf16=False,  # TRL defaults to bf16; the equivalence is checked in fp32
        )
        | case.config
    )
    if not sp and case.family in PADDED_REFERENCE:  # transformers' packed forward differs from each document alone
        common["padding_free"] = False  # right-padded rows: each document alone
    peft_config = None
    if case.lora:
        peft_config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"]
        )
    if sp:
        args = SFTConfig(
            per_device_train_batch_size=case.batch_size, sp_size=case.sp_size, ddp_backend="gloo", **common
        )
        trainer_cls = SPSFTTrainer
    elif ddp:  # TRL on dp processes: the reference where a loss is not a sum over tokens (the MoE router loss)
        args = trl.SFTConfig(per_device_train_batch_size=case.batch_size, ddp_backend="gloo", **common)
        trainer_cls = trl.SFTTrainer
    else:
        args = trl.SFTConfig(per_device_train_batch_size=global_batch, **common)
        trainer_cls = trl.SFTTrainer
    torch.manual_seed(0)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evals,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    init = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    eval_metrics = trainer.evaluate()
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    rank0 = not (sp or ddp) or dist.get_rank() == 0
    params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return {
        "losses": [e["loss"] for e in logs],
        "grad_norms": [e["grad_norm"] for e in logs],
        "token_accuracy": [e["mean_token_accuracy"] for e in logs],
        "aux_losses": [e["aux_loss"] for e in logs if "aux_loss" in e],
        "eval_loss": eval_metrics["eval_loss"],
        "eval_aux_loss": eval_metrics.get("eval_aux_loss"),
        "global_step": trainer.state.global_step,
        "params": params if rank0 else None,
        "init": init if rank0 else None,
        "is_peft": type(trainer.model).__name__,
    }


def reference_run(case, out_dir: str) -> dict:
    """Plain single-process ``Trainer`` / ``SFTTrainer`` for a ``Case`` or ``SFTCase`` whose SP run switches memory
    features on (they are the SP run's only: dropped from an SFT case's shared config)."""
    from hf_sp_trainer.memory import MemoryArguments
    from tests.harness import train_case

    if isinstance(case, SFTCase):
        memory_fields = {f.name for f in dataclasses.fields(MemoryArguments)}
        config = {k: v for k, v in case.config.items() if k not in memory_fields}
        return train_sft_case(dataclasses.replace(case, config=config), sp=False, out_dir=out_dir)
    return train_case(case, sp=False, out_dir=out_dir)
