"""ThroughputCallback: the logged keys and their values, the FLOPs formula by hand, no per-step synchronisation."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DataCollatorWithFlattening, TrainerControl, TrainerState

from hf_sp_trainer.integrations import throughput
from hf_sp_trainer.integrations.throughput import (
    ThroughputCallback,
    add_throughput_callback,
    attention_geometry,
    causal_pairs,
    device_peak_flops,
    matmul_params,
    training_flops,
)
from tests.harness import quiet_args, synthetic_dataset, tiny_model

pytestmark = pytest.mark.unit  # in-process

KEYS = ("tokens_per_second_per_rank", "step_time_s", "peak_memory_mb")


class FakePeak(ThroughputCallback):
    """MFU on CPU (the real callback reports none there), to test that path."""

    def resolve_peak_flops(self, device: torch.device) -> float | None:
        return 1e12


def _train(tmp_path, callback: ThroughputCallback, steps: int = 3, **extra):
    """Tiny Llama, plain Trainer, packed batches; returns the trainer, every forward's (training, input_ids,
    position_ids) and the wall time of ``train()``."""
    model = tiny_model("llama")
    seen: list[tuple[bool, torch.Tensor, torch.Tensor]] = []

    def record(module, args, kwargs):
        seen.append((module.training, kwargs["input_ids"].clone(), kwargs["position_ids"].clone()))

    model.register_forward_pre_hook(record, with_kwargs=True)
    grad_accum = extra.get("gradient_accumulation_steps", 1)
    common = quiet_args(str(tmp_path), steps) | dict(dataloader_num_workers=0, remove_unused_columns=False) | extra
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(per_device_train_batch_size=4, **common),
        train_dataset=synthetic_dataset(4 * steps * grad_accum, seed=1),
        eval_dataset=synthetic_dataset(4, seed=2),
        data_collator=DataCollatorWithFlattening(return_position_ids=True),
        callbacks=[callback],
    )
    start = time.perf_counter()
    trainer.train()
    return trainer, seen, time.perf_counter() - start


def _train_logs(trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "loss" in e]


def test_logged_keys_and_values(tmp_path):
    trainer, seen, wall = _train(tmp_path, ThroughputCallback(), eval_strategy="steps", eval_steps=2)
    entries = _train_logs(trainer)
    train_tokens = [ids.numel() for training, ids, _ in seen if training]
    assert len(entries) == 3 and len(train_tokens) == 3  # one log and one forward per step
    assert any(not training for training, _, _ in seen)  # evaluation ran in between, and is not counted
    for entry, tokens in zip(entries, train_tokens, strict=True):
        assert set(KEYS) <= entry.keys() and "mfu" not in entry  # no MFU on CPU
        assert entry["step_time_s"] > 0 and entry["peak_memory_mb"] > 0
        assert entry["tokens_per_second_per_rank"] == pytest.approx(tokens / entry["step_time_s"], rel=1e-4)
    assert sum(e["step_time_s"] for e in entries) < wall
    assert not any(k in e for e in trainer.state.log_history if "loss" not in e for k in KEYS)  # eval / summary


def test_window_spans_logging_steps_and_accumulation(tmp_path):
    """Two optimizer steps of two micro-batches each in one log: the tokens of all four forwards, mean step time."""
    trainer, seen, _ = _train(tmp_path, ThroughputCallback(), steps=2, gradient_accumulation_steps=2, logging_steps=2)
    (entry,) = _train_logs(trainer)
    tokens = sum(ids.numel() for training, ids, _ in seen if training)
    assert len(seen) == 4
    assert entry["tokens_per_second_per_rank"] * entry["step_time_s"] * 2 == pytest.approx(tokens, rel=1e-4)


def test_mfu_path(tmp_path):
    """With a peak FLOP/s, ``mfu`` = the hand-computed model FLOPs of the step / step time / peak."""
    trainer, seen, _ = _train(tmp_path, FakePeak(), steps=2)
    model = trainer.model
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)  # untied embedding
    layers, width = model.config.num_hidden_layers, model.config.num_attention_heads * model.config.head_dim
    for entry, (_, ids, pos) in zip(_train_logs(trainer), seen, strict=True):
        starts = [t for t in range(pos.shape[1]) if t == 0 or pos[0, t] != pos[0, t - 1] + 1] + [pos.shape[1]]
        pairs = sum((b - a) * (b - a + 1) // 2 for a, b in zip(starts, starts[1:], strict=False))
        flops = 6 * params * ids.numel() + 12 * layers * width * pairs
        assert entry["mfu"] == pytest.approx(flops / entry["step_time_s"] / 1e12, rel=1e-4)


def test_flops_formula_packed_by_hand():
    # one row, two documents of 3 and 5 tokens: 3*4/2 + 5*6/2 = 6 + 15 = 21 causal pairs
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert int(causal_pairs(position_ids)) == 21
    # 1 000 matmul weights, 8 tokens, 2 layers of 4 heads x 16: 6*1000*8 + 12*2*64*21 = 48 000 + 32 256
    assert training_flops(8, 21, 1000, 1000, 2, 64) == 80256
    # LoRA-like: 10 trainable weights -> forward 2N + activation grads 2N + weight grads 2 x 10, per token
    assert training_flops(8, 0, 1000, 10, 2, 64) == (4 * 1000 + 2 * 10) * 8
    # documents not starting at 0, 1-token documents, two rows, 1-D input
    assert int(causal_pairs(torch.tensor([[5, 6, 7, 0, 1], [0, 0, 0, 1, 2]]))) == (6 + 3) + (1 + 1 + 6)
    assert int(causal_pairs(torch.arange(4))) == 10


def test_params_and_geometry():
    model = tiny_model("llama")  # untied: the input embedding is a lookup, the LM head a matmul
    total, trainable = matmul_params(model)
    assert total == trainable == sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    model.model.layers.requires_grad_(False)
    assert matmul_params(model) == (total, total - sum(p.numel() for p in model.model.layers.parameters()))
    tied = tiny_model("llama", tie_word_embeddings=True)
    assert matmul_params(tied)[0] == sum(p.numel() for p in tied.parameters())  # counted once, as the LM head
    assert attention_geometry(model.config) == (2, 4 * 16)


def test_sequence_parallel_pairs():
    """Under SP the pairs come from the whole sequence's layout, divided over the SP ranks."""
    layout = SimpleNamespace(segments=[[(0, 3), (3, 8)]])
    sp = SimpleNamespace(layout=layout, topology=SimpleNamespace(sp_size=2))
    counter = throughput._Counter(count_pairs=True, documents=sp)
    module = torch.nn.Linear(1, 1)
    counter(module, (), {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, None)  # a shard of 4 tokens
    assert counter.tokens == 4 and counter.pairs() == 21 / 2


def test_counts_only_forwards_that_train():
    """Evaluation and no-grad forwards in training mode (TRL's generation, reference and old-policy scoring) are not
    training tokens."""
    counter = throughput._Counter(count_pairs=False)
    module, batch = torch.nn.Linear(1, 1), {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    with torch.no_grad():
        counter(module.train(), (), batch, None)
    counter(module.eval(), (), batch, None)
    assert counter.tokens == 0
    counter(module.train(), (), batch, None)
    assert counter.tokens == 4


class _SyncProbe(TorchDispatchMode):
    """Counts device-to-host reads (``.item()``, ``bool()``, ``.tolist()`` all go through ``_local_scalar_dense``)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_no_per_step_synchronisation(tmp_path):
    """Non-logging steps: the hook (with MFU's pair counting on) and the step events read nothing back."""
    model = tiny_model("llama").train()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    callback, state, control = FakePeak(), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, model=model)
    batch = {"input_ids": torch.ones(1, 8, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    with _SyncProbe() as probe:
        for _ in range(3):
            callback.on_step_begin(args, state, control)
            callback._counter(model, (), batch, None)
            callback.on_step_end(args, state, control)
    assert probe.reads == 0
    assert callback._counter.tokens == 24 and callback._counter.pairs() == 63  # read back at the log only


def test_peak_memory_without_reset_permission(tmp_path, monkeypatch):
    """Where /proc/self/clear_refs can't be written, the peak since the process start is reported (one warning)."""
    monkeypatch.setattr(throughput, "_reset_vm_hwm", lambda: False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    callback, state, control = ThroughputCallback(), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, model=tiny_model("llama"))
    callback.on_step_begin(args, state, control)
    callback.on_step_end(args, state, control)
    state.log_history.append({"loss": 1.0, "step": 0})
    logs = {"loss": 1.0}
    callback.on_log(args, state, control, logs=logs)
    assert logs["peak_memory_mb"] > 0 and callback._warned_reset
    assert state.log_history[-1]["peak_memory_mb"] == logs["peak_memory_mb"]
    callback.on_log(args, state, control, logs={"eval_loss": 1.0})  # not a training log: nothing added, no error


def test_add_throughput_callback_goes_first(tmp_path):
    trainer = transformers.Trainer(
        model=tiny_model("llama"),
        args=transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
    )
    callback = add_throughput_callback(trainer)
    callbacks = trainer.callback_handler.callbacks
    assert isinstance(callbacks[0], transformers.trainer_callback.DefaultFlowCallback) and callbacks[1] is callback
    assert add_throughput_callback(trainer) is callback and callbacks.count(callback) == 1


def test_device_peak_flops(monkeypatch):
    monkeypatch.delenv(throughput.PEAK_FLOPS_ENV, raising=False)
    assert device_peak_flops("NVIDIA H200") == 989e12
    assert device_peak_flops("NVIDIA H20") == 148e12
    assert device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device_peak_flops("Some Accelerator") is None
    monkeypatch.setenv(throughput.PEAK_FLOPS_ENV, "1.5e14")
    assert device_peak_flops("NVIDIA H200") == 1.5e14
    assert ThroughputCallback(peak_flops=1.0).resolve_peak_flops(torch.device("cpu")) is None  # no MFU on CPU
