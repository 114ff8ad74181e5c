"""SPTrainer with sp_size=1 is exactly transformers.Trainer; under SP on CPU the batch reaches the model uncopied."""

import pytest
import torch
import transformers

from hf_sp_trainer import SPDataCollator, SPTrainer, TrainingArguments
from tests.harness import run_distributed, synthetic_dataset, tiny_model, unwrap_results

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not


def _run(trainer_cls, args_cls, tmp):
    args = args_cls(
        output_dir=tmp,
        per_device_train_batch_size=2,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        save_strategy="no",
    )
    trainer = trainer_cls(
        model=tiny_model("llama"),
        args=args,
        train_dataset=synthetic_dataset(4, seed=7),
        data_collator=transformers.DataCollatorWithFlattening(return_position_ids=True),
    )
    trainer.train()
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]


def test_sp_size_1_is_plain_trainer(tmp_path):
    ours = _run(SPTrainer, TrainingArguments, str(tmp_path / "ours"))
    theirs = _run(transformers.Trainer, transformers.TrainingArguments, str(tmp_path / "theirs"))
    assert ours == theirs and len(ours) == 2


def test_sp_size_1_packs_ragged_rows_as_sp_does(tmp_path):
    """Without a collator, SPTrainer at sp_size=1 packs the batch as under SP (the base Trainer's default collator
    can't stack ragged rows): the same training as plain Trainer with the flattening collator."""
    rows = synthetic_dataset(4, seed=7, min_len=5, max_len=40)
    assert len({len(r["input_ids"]) for r in rows}) > 1  # ragged

    def run(trainer_cls, args_cls, tmp, **collator):
        args = args_cls(
            output_dir=tmp, per_device_train_batch_size=2, max_steps=2, logging_steps=1, report_to="none",
            disable_tqdm=True, use_cpu=True, save_strategy="no",
        )  # fmt: skip
        trainer = trainer_cls(model=tiny_model("llama"), args=args, train_dataset=rows, **collator)
        trainer.train()
        return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]

    with pytest.raises(ValueError, match="expected sequence of length"):  # what sp_size=1 did before
        run(transformers.Trainer, transformers.TrainingArguments, str(tmp_path / "default"))
    flattening = transformers.DataCollatorWithFlattening(return_position_ids=True)
    theirs = run(
        transformers.Trainer, transformers.TrainingArguments, str(tmp_path / "theirs"), data_collator=flattening
    )
    ours = run(SPTrainer, TrainingArguments, str(tmp_path / "ours"))
    assert ours == theirs and len(ours) == 2


def test_training_arguments_fields():
    fields = TrainingArguments.__dataclass_fields__
    assert fields["sp_size"].default == 1 and "help" in fields["sp_size"].metadata
    assert fields["sp_attn_implementation"].default is None


def _storages_seen(out_dir: str) -> dict:
    """The storages of the collated ``input_ids`` and of those the model's forward received, one step at sp 2."""
    collated, seen = [], []
    collate = SPDataCollator()

    def collator(features):
        batch = collate(features)
        collated.append(batch["input_ids"].untyped_storage().data_ptr())
        return batch

    model = tiny_model("llama")
    model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["input_ids"].untyped_storage().data_ptr()), with_kwargs=True
    )
    rows = [{"input_ids": list(range(3, 35)), "labels": list(range(3, 35))}] * 2  # 64 tokens: no SP padding
    args = TrainingArguments(
        output_dir=out_dir, sp_size=2, max_steps=1, per_device_train_batch_size=2, report_to="none", use_cpu=True,
        save_strategy="no", ddp_backend="gloo", disable_tqdm=True,
    )  # fmt: skip
    trainer = SPTrainer(model=model, args=args, train_dataset=rows, data_collator=collator)
    trainer.train()
    return {"device": str(args.device), "collated": collated, "seen": seen}


@pytest.mark.dist
def test_sp_on_cpu_feeds_the_collated_batch_uncopied(tmp_path):
    """accelerate's distributed CPU device is ``cpu:0`` and torch copies a CPU tensor on ``.to("cpu:0")``: the data
    loader and the Trainer's input preparation each copied every batch (a long multimodal row's pixels included).
    The shard the model sees is a view of the collated row."""
    for rank in unwrap_results(run_distributed(2, _storages_seen, str(tmp_path))):
        assert rank["device"] == "cpu:0", rank  # the device that made the copies
        assert rank["seen"] and set(rank["seen"]) <= set(rank["collated"]), rank
    t = torch.randn(2)
    assert t.to("cpu:0").data_ptr() != t.data_ptr()  # torch still copies there: the case this test guards is real


def _dp2_runs(out_dir: str) -> dict:
    """On each rank of a 2-process world: plain ``Trainer`` DDP with the flattening collator, then SPTrainer at
    ``sp_size=1`` (data parallelism alone) without a collator, on the same ragged rows."""
    rows = synthetic_dataset(8, seed=3, min_len=5, max_len=40)
    out = {}
    for name, trainer_cls, args_cls, collator in (
        ("plain", transformers.Trainer, transformers.TrainingArguments,
         {"data_collator": transformers.DataCollatorWithFlattening(return_position_ids=True)}),
        ("ours", SPTrainer, TrainingArguments, {}),
    ):  # fmt: skip
        args = args_cls(
            output_dir=f"{out_dir}/{name}", per_device_train_batch_size=2, max_steps=2, logging_steps=1,
            report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no", ddp_backend="gloo",
        )  # fmt: skip
        model = tiny_model("llama")
        trainer = trainer_cls(model=model, args=args, train_dataset=rows, eval_dataset=rows[:4], **collator)
        trainer.train()
        logs = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]
        out[name] = {
            "logs": logs,
            "eval": trainer.evaluate()["eval_loss"],
            "params": [p.detach().clone() for p in model.parameters()],
        }
    return out


@pytest.mark.dist
def test_dp2_sp1_packs_ragged_rows(tmp_path):
    """dp 2 x sp 1 on ragged rows (before: the base Trainer's collator failed on them) trains as plain Trainer DDP
    with the flattening collator, bit for bit."""
    for rank in unwrap_results(run_distributed(2, _dp2_runs, str(tmp_path))):
        ours, plain = rank["ours"], rank["plain"]
        assert ours["logs"] == plain["logs"] and len(ours["logs"]) == 2 and ours["eval"] == plain["eval"]
        assert all(torch.equal(a, b) for a, b in zip(ours["params"], plain["params"], strict=True))
