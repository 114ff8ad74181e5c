"""SPTrainer with sp_size=1 is exactly transformers.Trainer."""

import transformers

from hf_sp_trainer import SPTrainer, TrainingArguments
from tests.harness import synthetic_dataset, tiny_model


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
