"""``checkpoint_policy="auto"``: as many layers keep their attention outputs as ``checkpoint_memory_budget`` allows,
forward by forward, and every choice trains exactly like full checkpointing (kept values are the recomputed ones).
Under SP: ``test_checkpointing.py::auto_llama_sp2_ga2`` against one process."""

from __future__ import annotations

import pytest
import torch

from hf_sp_trainer.integrations.memory_budget import KEPT_LAYERS_LOG, largest_over_ranks
from hf_sp_trainer.memory.checkpointing import KEEP_BUDGET_MARK
from hf_sp_trainer.memory.keep_budget import KeepBudget, budget_bytes, exchange_kept_bytes, sequence_aware_kept_bytes
from tests.harness import (
    enable_checkpointing,
    logged_steps,
    quiet_args,
    run_distributed,
    synthetic_dataset,
    tiny_model,
    unwrap_results,
)

pytestmark = pytest.mark.unit  # in-process

KEEP = object()  # the context a kept layer gets
EXCHANGE = object()  # the context of a layer keeping its all-to-all results too


def _forward(keep: KeepBudget, layers: int, tokens: int) -> list[bool]:
    keep.start_forward()
    hidden = torch.zeros(1, tokens, 4)
    return [keep.context_for(hidden) is KEEP for _ in range(layers)]


def test_the_budget_decides_layer_by_layer():
    keep = KeepBudget(budget=1000, layer_bytes=10, keep_context=KEEP)
    for resident, peak in ((100, 900), (300, 700)):  # two warm-up steps keep nothing; the second measures 100 / token
        keep.start_step(resident)
        assert _forward(keep, 3, 4) == [False] * 3
        keep.end_step(peak)
    assert keep.per_token == 100 and keep.measured_steps == 2
    keep.start_step(300)
    assert _forward(keep, 12, 4) == [True] * 7 + [False] * 5  # 1000 - 300 - 400 = 300 left, 40 per layer
    keep.end_step(980)  # 280 kept + 700 predicted: as predicted, nothing changes
    assert keep.per_token == 100 and keep.overshoot == 0
    assert _forward(keep, 12, 2) == [True] * 12  # 2 tokens: 500 left, 20 per layer
    assert _forward(keep, 12, 6) == [True] + [False] * 11  # 6 tokens: 1000 - 300 - 600 = 100 left, 60 per layer
    assert _forward(keep, 12, 8) == [False] * 12  # 8 tokens: nothing left
    assert keep.kept_layers == [0, 0, 7, 12, 1, 0]
    keep.end_step(None)  # not measurable: nothing learnt
    keep.start_step(300)
    assert _forward(keep, 12, 4) == [True] * 7 + [False] * 5
    keep.end_step(1080)  # 280 kept: 800 besides, 100 more than predicted; corrected from the next step on
    assert keep.overshoot == 100
    assert _forward(keep, 12, 4) == [True] * 5 + [False] * 7
    keep.end_step(900)  # under the prediction: the correction stays
    assert keep.overshoot == 100


def _contexts(keep: KeepBudget, layers: int, tokens: int) -> list[str]:
    keep.start_forward()
    hidden = torch.zeros(1, tokens, 4)
    names = {id(KEEP): "keep", id(EXCHANGE): "exchange", id(None): "none"}
    return [names[id(keep.context_for(hidden))] for _ in range(layers)]


def test_the_all_to_all_results_are_kept_once_every_layer_keeps_its_outputs():
    """The second level: only where all layers keep their attention outputs, then as many as the rest holds."""
    keep = KeepBudget(budget=1000, layer_bytes=10, keep_context=KEEP, exchange_bytes=20, exchange_context=EXCHANGE)
    for _ in range(2):  # warm-up: nothing kept; 50 bytes per token measured, 3 layers per forward counted
        keep.start_step(300)
        assert _contexts(keep, 3, 4) == ["none"] * 3
        keep.end_step(500)
    assert keep.per_token == 50 and keep.layers == 3
    keep.start_step(300)
    assert _contexts(keep, 3, 4) == ["exchange"] * 3  # 500 allowed: 3 x 40 + 3 x 80 = 360
    assert _contexts(keep, 3, 6) == ["exchange", "keep", "keep"]  # 400: 3 x 60, then 220 // 120 = 1
    assert _contexts(keep, 3, 8) == ["keep"] * 3  # 300: 3 x 80, then 60 < 160
    assert _contexts(keep, 3, 9) == ["keep"] * 2 + ["none"]  # 250: not every layer keeps its outputs
    assert keep.kept_exchanges == [0, 0, 3, 1, 0, 0] and keep.kept_layers == [0, 0, 3, 3, 3, 2]
    keep.end_step(1000)  # the largest kept set was 360 at 4 tokens: 700 predicted, 60 under the prediction
    assert keep.overshoot == 0
    without = KeepBudget(budget=1000, layer_bytes=10, keep_context=KEEP)  # no Ulysses: no second level
    without.per_token, without.measured_steps, without.layers = 50, 2, 3
    assert _contexts(without, 3, 4) == ["keep"] * 3 and without.kept_exchanges == [0]


def test_where_even_full_checkpointing_would_not_fit_layers_offload_their_checkpoint():
    """Below full checkpointing: the first layers offload, as many as it takes (all, at worst); then the correction
    counts the offloaded bytes back in."""
    hooks = object()
    keep = KeepBudget(budget=1000, layer_bytes=10, keep_context=KEEP, offload_bytes=10, offload=hooks)
    keep.per_token, keep.measured_steps, keep.layers, keep.resident = 200, 2, 4, 300
    hidden = torch.zeros(1, 4, 4)

    def forward(tokens: int) -> list[tuple[bool, bool]]:
        keep.start_forward()
        hidden = torch.zeros(1, tokens, 4)
        return [(ctx is KEEP, off is hooks) for ctx, off in (keep.decide(hidden) for _ in range(4))]

    assert forward(4) == [(False, True)] * 3 + [(False, False)]  # 100 short, 40 a layer: 3 offload
    keep.end_step(1030)  # predicted 300 + 800, less 120 offloaded: 50 over
    assert keep.overshoot == 50 and keep.per_token == 200
    assert forward(4) == [(False, True)] * 4  # now 150 short, with the correction: all four
    assert forward(5) == [(False, True)] * 4  # 310 short: even all four (200) are not enough
    assert forward(2) == [(True, False)] * 4  # 1000 - 300 - 400 - 50 = 250 left: no offload, all keep
    assert keep.offloaded_layers == [3, 4, 4, 0] and keep.kept_layers == [0, 0, 0, 4]
    without = KeepBudget(budget=1000, layer_bytes=10, keep_context=KEEP, offload_bytes=10)  # no hooks: no offload
    without.per_token, without.measured_steps, without.layers, without.resident = 200, 2, 4, 300
    without.start_forward()
    assert without.decide(hidden) == (None, None) and without.offloaded_layers == [0]


def test_offloaded_checkpoints_train_like_full_checkpointing():
    """The offload the budget chooses, through the real checkpoint wrapper (host copies: CPU): the chosen layers'
    checkpoints go to the hooks, the gradients are full checkpointing's, bit for bit."""
    from hf_sp_trainer.memory.checkpointing import wrap_checkpointed_layers
    from hf_sp_trainer.memory.offload import HostOffload

    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    grads = []
    for offload in (False, True):
        model = tiny_model("llama").train()
        enable_checkpointing(model)
        hooks = HostOffload("cpu", min_bytes=1)
        keep = KeepBudget(budget=1.0, layer_bytes=1.0, keep_context=KEEP, offload_bytes=1.0, offload=hooks)
        keep.per_token, keep.measured_steps, keep.layers = (1e9, 2, 1) if offload else (0.0, 0, 0)
        wrap_checkpointed_layers(model, keep)
        keep.start_forward()
        model(input_ids=ids, labels=ids).loss.backward()
        assert keep.offloaded_layers == [1 if offload else 0] and (hooks.packed > 0) == offload, hooks.packed
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_budget_bytes_and_kept_bytes():
    assert budget_bytes(5e9, torch.device("cpu")) == 5e9
    with pytest.raises(ValueError, match="fraction of the device's memory, which only CUDA"):
        budget_bytes(0.9, torch.device("cpu"))
    with pytest.raises(ValueError, match="must be positive"):
        KeepBudget(0, 1.0, KEEP)
    assert sequence_aware_kept_bytes(10, 64, 2) == 1280
    assert sequence_aware_kept_bytes(10, 64, 2, ring=3) == 2560  # each ring block's output
    assert exchange_kept_bytes(10, 64, 32, 2) == 3840  # q, k, v received and the output: (64 + 32 + 32 + 64) x 2 x 10


def _train(tmp_path, policy: str, budget: float | None = None) -> tuple[list, dict, list]:
    from transformers import DataCollatorWithFlattening

    from hf_sp_trainer import SPTrainer, TrainingArguments

    args = TrainingArguments(
        **quiet_args(str(tmp_path / policy / str(budget)), 4), per_device_train_batch_size=3, optim="sgd",
        learning_rate=5e-2, gradient_checkpointing=True, checkpoint_policy=policy, checkpoint_memory_budget=budget,
    )  # fmt: skip
    model = tiny_model("llama")
    trainer = SPTrainer(
        model=model, args=args, train_dataset=synthetic_dataset(12, seed=1),
        data_collator=DataCollatorWithFlattening(return_position_ids=True),
    )  # fmt: skip
    trainer.train()
    kept = [e.get(KEPT_LAYERS_LOG) for e in trainer.state.log_history if "grad_norm" in e]
    return logged_steps(trainer), {k: v.detach().clone() for k, v in model.named_parameters()}, kept


def test_auto_trains_like_full_checkpointing_whatever_it_keeps(tmp_path):
    steps, params, _ = _train(tmp_path, "full")
    layers = tiny_model("llama").config.num_hidden_layers
    for budget, expected in ((1e15, [0, 0] + [layers] * 2), (2.0, [0] * 4)):
        got_steps, got_params, kept = _train(tmp_path, "auto", budget)
        assert kept == expected, (budget, kept)
        assert got_steps == steps  # bitwise: a kept output is the recomputed one
        assert all(torch.equal(got_params[k], params[k]) for k in params)


def test_auto_needs_a_budget(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_policy='auto' needs checkpoint_memory_budget"):
        _train(tmp_path, "auto")


def test_the_model_holds_its_budget(tmp_path):
    from hf_sp_trainer import SPTrainer, TrainingArguments

    args = TrainingArguments(**quiet_args(str(tmp_path), 1), gradient_checkpointing=True, checkpoint_policy="auto",
                             checkpoint_memory_budget=1e9)  # fmt: skip
    model = tiny_model("llama")
    SPTrainer(model=model, args=args, train_dataset=synthetic_dataset(2))
    first = getattr(model, KEEP_BUDGET_MARK)
    SPTrainer(model=model, args=args, train_dataset=synthetic_dataset(2))  # a second trainer on the same model
    second = getattr(model, KEEP_BUDGET_MARK)
    assert second is not first
    assert first._hook.id not in model._forward_pre_hooks and second._hook.id in model._forward_pre_hooks


def _largest(values: list) -> float | None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return largest_over_ranks(values[dist.get_rank()], torch.device("cpu"))


@pytest.mark.dist
def test_every_rank_is_handed_the_largest_figure():
    """The ranks of an SP group decide alike (with a ring, a kept layer's recompute skips the kernel's K/V passes)."""
    for values, expected in (([3.0, 5.0], 5.0), ([None, 2.0], 2.0), ([None, None], None)):
        assert unwrap_results(run_distributed(2, _largest, values)) == [expected, expected]
