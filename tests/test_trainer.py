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
