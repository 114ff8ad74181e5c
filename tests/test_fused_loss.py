"""fused_loss: the chunked LM head + cross-entropy trains exactly like the full logits, and never builds them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hf_sp_trainer.losses.fused import has_fused_loss
from tests.harness import (
    VOCAB,
    Case,
    assert_case,
    backend_args,
    compare,
    quiet_args,
    record_inputs,
    run_cases,
    run_distributed,
    synthetic_dataset,
    tiny_model,
    train_case,
    unwrap_results,
)

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not


@dataclass(frozen=True)
class FusedCase:
    name: str
    family: str = "llama"
    sp_size: int = 2
    batch_size: int = 3
    grad_accum: int = 1
    steps: int = 3
    masked_prompt: bool = False
    lora: bool = False
    model_overrides: dict = field(default_factory=dict)
    fused: bool = False

    def train(self, sp: bool, out_dir: str) -> dict:
        return train_fused_case(self, self.fused, out_dir)


SP2 = [
    FusedCase("llama"),
    FusedCase("llama_ga2_masked_empty_shards", batch_size=1, grad_accum=2, masked_prompt=True),
    FusedCase("llama_lora_with_lm_head", lora=True),
    FusedCase("llama_tied_embeddings", model_overrides={"tie_word_embeddings": True}),
    FusedCase("gemma3_softcapping", family="gemma3", model_overrides={"final_logit_softcapping": 0.5}),
]
SINGLE = FusedCase("single_process_ga2_masked", sp_size=1, grad_accum=2, masked_prompt=True)
# Sharded LM-head weight: fused SP runs vs plain single-process Trainer (intermediate 96: only logits have 128 columns)
ZERO3 = backend_args("zero3")["deepspeed"]
ZERO3["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition the small LM head too
BACKENDS = [
    Case(f"{b}_fused", backend=b, sp_overrides={"fused_loss": True, **over}, model_overrides={"intermediate_size": 96})
    for b, over in (("fsdp2", {}), ("zero3", {"deepspeed": ZERO3}))
]


def _model(case: FusedCase):
    model = tiny_model(case.family, **case.model_overrides)
    if case.lora:
        import peft

        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    return model


def train_fused_case(case: FusedCase, fused: bool, out_dir: str) -> dict:
    """Train ``case`` with SPTrainer; return losses, grad norms, eval/test loss, predictions and parameters."""
    from transformers import DataCollatorWithFlattening

    from hf_sp_trainer import SPTrainer, TrainingArguments

    model = _model(case)
    init = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    train = synthetic_dataset(case.batch_size * case.grad_accum * case.steps, seed=1, masked_prompt=case.masked_prompt)
    evals = synthetic_dataset(4, seed=2, masked_prompt=case.masked_prompt)
    args = TrainingArguments(
        **quiet_args(out_dir, case.steps),
        sp_size=case.sp_size,
        fused_loss=fused,
        per_device_train_batch_size=case.batch_size,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=case.grad_accum,
        learning_rate=1e-3,
        weight_decay=0.01,
        remove_unused_columns=False,
        **({"ddp_backend": "gloo"} if case.sp_size > 1 else {}),
    )
    collator = DataCollatorWithFlattening(return_position_ids=True) if case.sp_size == 1 else None  # SP packs itself
    trainer = SPTrainer(model=model, args=args, data_collator=collator, train_dataset=train, eval_dataset=evals)
    head_rows = []  # tokens per LM-head call: whole shards unfused, chunks fused
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda _m, a, _o: head_rows.append(a[0].reshape(-1, a[0].shape[-1]).shape[0]))
    seen = record_inputs(model)
    trainer.train()
    train_rows, head_rows[:] = max(head_rows), []
    eval_loss = trainer.evaluate()["eval_loss"]  # no compute_metrics: loss only, fused
    eval_rows = max(head_rows)
    prediction = trainer.predict(evals[:2])  # logits needed: the unfused forward
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    params = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    return {
        "losses": [e["loss"] for e in logs],
        "grad_norms": [e["grad_norm"] for e in logs],
        "eval_loss": eval_loss,
        "predictions": torch.as_tensor(prediction.predictions),
        "test_loss": prediction.metrics["test_loss"],
        "params": params if rank0 else None,
        "init": init if rank0 else None,
        "head_rows": (train_rows, eval_rows),
        "empty_shards": sum(int((x["shift_labels"] != -100).sum() == 0) for x in seen if "shift_labels" in x),
    }


def pairs(*cases: FusedCase) -> list[FusedCase]:
    """Each case unfused, then fused."""
    return [replace(c, name=f"{c.name}_{'fused' if f else 'unfused'}", fused=f) for c in cases for f in (False, True)]


@contextlib.contextmanager
def count_train_head_calls(_case):
    """A ``run_cases`` probe: LM-head-shaped outputs (VOCAB columns) computed in training mode."""
    counts = {"train_head_calls": 0}

    def hook(module, _args, output):
        if module.training and isinstance(output, torch.Tensor) and output.ndim >= 2 and output.shape[-1] == VOCAB:
            counts["train_head_calls"] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield counts
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def sp2_results():
    return unwrap_results(run_distributed(2, run_cases, pairs(*SP2) + BACKENDS, count_train_head_calls))[0]


def _check(case: FusedCase, ref: dict, got: dict) -> None:
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert len(got["losses"]) == case.steps
    assert_case(case, diffs, ref)
    for phase, fused_rows, full_rows in zip(("train", "eval"), got["head_rows"], ref["head_rows"], strict=True):
        assert fused_rows < full_rows, f"{case.name}: fused {phase} should call the LM head on chunks"
    if case.masked_prompt and case.sp_size > 1:
        assert got["empty_shards"] > 0, "the case was meant to contain shards whose labels are all -100"


@pytest.mark.dist
@pytest.mark.parametrize("case", SP2, ids=lambda c: c.name)
def test_fused_matches_unfused_sp2(case, sp2_results):
    _check(case, sp2_results[f"{case.name}_unfused"], sp2_results[f"{case.name}_fused"])


@pytest.mark.dist
@pytest.mark.parametrize("case", BACKENDS, ids=lambda c: c.name)
def test_fused_with_sharded_lm_head(case, sp2_results, tmp_path):
    """FSDP2 / ZeRO-3 shard the LM-head weight; the fused loss still gives the single-process training."""
    got = sp2_results[case.name]
    ref = train_case(case, sp=False, out_dir=str(tmp_path))
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert_case(case, diffs, ref)
    # unfused: one LM-head call per step; fused: 2 chunks, each run again in backward
    assert got["train_head_calls"] >= 4 * case.steps, got["train_head_calls"]


def test_fused_matches_unfused_single_process(tmp_path):
    results = run_cases(pairs(SINGLE))
    _check(SINGLE, results[f"{SINGLE.name}_unfused"], results[f"{SINGLE.name}_fused"])


class _LargestLogits(TorchDispatchMode):
    """Records the most rows of any tensor an op produces with ``vocab`` columns (logits-shaped)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("fused", [False, True])
def test_full_logits_never_materialised(fused, tmp_path):
    """One training step and one evaluation: no [tokens, vocab] tensor exists with fused_loss (it does without)."""
    from transformers import DataCollatorWithFlattening

    from hf_sp_trainer import SPTrainer, TrainingArguments

    model = tiny_model("llama", intermediate_size=96)  # no other tensor has VOCAB=128 columns
    tokens = 100  # more than hidden_size=64: the transposed LM-head weight has 64 rows of VOCAB columns
    rows = [{"input_ids": [3 + i % (VOCAB - 3) for i in range(tokens)]}]
    args = TrainingArguments(
        output_dir=str(tmp_path), fused_loss=fused, max_steps=1, per_device_train_batch_size=1, report_to="none",
        use_cpu=True, save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
    )  # fmt: skip
    collator = DataCollatorWithFlattening(return_position_ids=True)
    trainer = SPTrainer(model=model, args=args, data_collator=collator, train_dataset=rows, eval_dataset=rows)
    with _LargestLogits(VOCAB) as probe:
        trainer.train()
        trainer.evaluate()
    assert probe.rows < tokens if fused else probe.rows == tokens, probe.rows


def test_fused_loss_refuses_label_smoothing(tmp_path):
    from hf_sp_trainer import SPTrainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), fused_loss=True, label_smoothing_factor=0.1, use_cpu=True)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1"):
        SPTrainer(model=tiny_model("llama"), args=args, train_dataset=synthetic_dataset(2))


def test_fused_loss_refuses_logit_scale(tmp_path):
    from hf_sp_trainer.losses.fused import enable_fused_loss

    model = tiny_model("llama")
    model.config.logit_scale = 0.5  # what Cohere's forward multiplies the logits by
    with pytest.raises(ValueError, match="logit_scale=0.5"):
        enable_fused_loss(model)


def _sft_trainer(out_dir: str, **config):
    from hf_sp_trainer import SFTConfig, SPSFTTrainer
    from hf_sp_trainer.data import build_char_tokenizer
    from tests.sft_harness import sft_dataset

    args = SFTConfig(
        output_dir=out_dir, max_steps=2, per_device_train_batch_size=2, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, use_cpu=True, padding_free=True, max_length=None,
        dataset_num_proc=None, bf16=False, **config,
    )  # fmt: skip
    data, tokenizer = sft_dataset("text", 4, seed=11), build_char_tokenizer()
    return SPSFTTrainer(model=tiny_model("llama"), args=args, train_dataset=data, processing_class=tokenizer)


def test_sft_fused_loss_is_trls_fused_head(tmp_path):
    """With SFTConfig, fused_loss=True keeps TRL's own fused nll loss: nothing patched, the same training."""
    losses = {}
    for fused in (False, True):
        trainer = _sft_trainer(str(tmp_path / str(fused)), fused_loss=fused)
        assert not has_fused_loss(trainer.model)
        trainer.train()
        losses[fused] = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]
    assert losses[True] == losses[False] and len(losses[True]) == 2


def test_sft_fused_loss_refuses_label_smoothing(tmp_path):
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1"):
        _sft_trainer(str(tmp_path), fused_loss=True, label_smoothing_factor=0.1)
