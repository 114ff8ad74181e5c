"""Every token of every sample is trained exactly once per epoch across DP x SP, on every backend (DDP, FSDP2,
DeepSpeed ZeRO 1/2/3), and step counts are right."""

import pytest

from tests.harness import backend_args, record_inputs, reset_backend_state, run_distributed, tiny_model, unwrap_results

pytestmark = pytest.mark.dist  # spawned gloo worlds (tests/pool.py)

N_SAMPLES, BATCH, GRAD_ACCUM = 24, 3, 2


def unique_token_dataset():
    """Sample i holds token ids no other sample uses, so each consumed token names its sample and position."""
    data, next_id = [], 3
    for i in range(N_SAMPLES):
        length = 6 + (i * 5) % 7
        data.append({"input_ids": list(range(next_id, next_id + length))})
        next_id += length
    return data


# every backend at dp 2 x sp 2; sp 4 (dp 1) under DDP, FSDP2 and ZeRO-3
LAYOUTS = [(2, "ddp"), (4, "ddp"), (2, "fsdp2"), (4, "fsdp2"), (2, "zero1"), (2, "zero2"), (2, "zero3"), (4, "zero3")]


def consume_one_epoch(sp_size, backend, tmp):
    from hf_sp_trainer import SPTrainer, TrainingArguments

    reset_backend_state()
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
        **backend_args(backend),
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
    return {(sp, backend): consume_one_epoch(sp, backend, f"{tmp}/{backend}_sp{sp}") for sp, backend in LAYOUTS}


@pytest.fixture(scope="module")
def consumed(tmp_path_factory):
    return unwrap_results(run_distributed(4, run_layouts, str(tmp_path_factory.mktemp("cov")), timeout=300))


@pytest.mark.parametrize("sp_size,backend", LAYOUTS)
def test_each_token_trained_once_per_epoch(sp_size, backend, consumed):
    data = unique_token_dataset()
    all_tokens = sorted(t for s in data for t in s["input_ids"])
    all_targets = sorted(t for s in data for t in s["input_ids"][1:])  # the first token of a sample is no target
    per_rank = [r[sp_size, backend] for r in consumed]
    assert sorted(t for r in per_rank for t in r["inputs"]) == all_tokens
    assert sorted(t for r in per_rank for t in r["targets"]) == all_targets


@pytest.mark.parametrize("sp_size,backend", LAYOUTS)
def test_step_counts(sp_size, backend, consumed):
    dp = 4 // sp_size
    batches_per_rank = N_SAMPLES // (BATCH * dp)
    for r in consumed:
        assert r[sp_size, backend]["num_batches"] == batches_per_rank
        assert r[sp_size, backend]["global_step"] == batches_per_rank // GRAD_ACCUM
        assert r[sp_size, backend]["epoch"] == 1.0
