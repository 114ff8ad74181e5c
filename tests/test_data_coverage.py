"""Every token of every sample is trained exactly once per epoch across DP x SP, and step counts are right."""

import pytest

from tests.harness import record_inputs, run_distributed, tiny_model, unwrap_results

N_SAMPLES, BATCH, GRAD_ACCUM = 24, 3, 2


def unique_token_dataset():
    """Sample i holds token ids no other sample uses, so each consumed token names its sample and position."""
    data, next_id = [], 3
    for i in range(N_SAMPLES):
        length = 6 + (i * 5) % 7
        data.append({"input_ids": list(range(next_id, next_id + length))})
        next_id += length
    return data


def consume_one_epoch(sp_size, tmp):
    from hf_sp_trainer import SPTrainer, TrainingArguments

    model = tiny_model("llama", vocab_size=1024)
    seen = record_inputs(model)
    args = TrainingArguments(
        output_dir=tmp,
        sp_size=sp_size,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=GRAD_ACCUM,
        num_train_epochs=1,
        optim="sgd",
        learning_rate=1e-3,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        logging_steps=1,
    )
    trainer = SPTrainer(model=model, args=args, train_dataset=unique_token_dataset())
    trainer.train()
    return {
        "inputs": [t for x in seen for t in x["input_ids"].flatten().tolist() if t != 0],
        "targets": [t for x in seen for t in x["shift_labels"].flatten().tolist() if t != -100],
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "num_batches": len(trainer.get_train_dataloader()),
    }


def run_layouts(tmp):
    return {sp: consume_one_epoch(sp, f"{tmp}/sp{sp}") for sp in (2, 4)}


@pytest.fixture(scope="module")
def consumed(tmp_path_factory):
    return unwrap_results(run_distributed(4, run_layouts, str(tmp_path_factory.mktemp("cov")), timeout=300))


@pytest.mark.parametrize("sp_size", [2, 4])
def test_each_token_trained_once_per_epoch(sp_size, consumed):
    data = unique_token_dataset()
    all_tokens = sorted(t for s in data for t in s["input_ids"])
    all_targets = sorted(t for s in data for t in s["input_ids"][1:])  # the first token of a sample is no target
    per_rank = [r[sp_size] for r in consumed]
    assert sorted(t for r in per_rank for t in r["inputs"]) == all_tokens
    assert sorted(t for r in per_rank for t in r["targets"]) == all_targets


@pytest.mark.parametrize("sp_size", [2, 4])
def test_step_counts(sp_size, consumed):
    dp = 4 // sp_size
    batches_per_rank = N_SAMPLES // (BATCH * dp)
    for r in consumed:
        assert r[sp_size]["num_batches"] == batches_per_rank
        assert r[sp_size]["global_step"] == batches_per_rank // GRAD_ACCUM
        assert r[sp_size]["epoch"] == 1.0
