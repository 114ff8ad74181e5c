"""``fused_loss`` through Liger's fused linear cross-entropy (its Triton kernels interpreted on CPU: under
``TRITON_INTERPRET=1`` ``fused_loss.liger_runs_on`` accepts CPU tensors): the loss and every gradient against the
chunked torch loss and a plain cross-entropy of the full logits, and SPTrainer with ``fused_loss=True`` at sp 1 and
sp 2 against plain ``transformers.Trainer``. Tolerance: the project's 1e-5 relative."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_sp_trainer.losses.fused import fused_linear_cross_entropy, liger_runs_on
from tests.harness import (
    assert_within,
    compare,
    logged_steps,
    quiet_args,
    synthetic_dataset,
    tiny_model,
    train_case,
)
from tests.interpreter.workers import train_head_calls
from tests.interpreter.worlds import LIGER_SP2

pytestmark = [pytest.mark.triton_interpret, pytest.mark.unit]  # the test marked dist below is not

TOL = 1e-5


class SubclassedHead(nn.Linear):
    """Not a plain ``nn.Linear``: ``fused_linear_cross_entropy`` takes its chunked torch path for it."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _loss_and_grads(kind: str, hidden, targets, weight, bias, softcap, num_items) -> tuple[torch.Tensor, list, int]:
    """``kind``: "liger" (a plain head: Liger), "chunked" (a subclassed head) or "plain" (full logits)."""
    cls = SubclassedHead if kind == "chunked" else nn.Linear
    head = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        head.weight.copy_(weight)
        if bias is not None:
            head.bias.copy_(bias)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    x = hidden.clone().requires_grad_()
    if kind == "plain":
        logits = head(x)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / num_items
    else:
        loss = fused_linear_cross_entropy(x, targets, head, num_items, softcap, chunk_tokens=16)
    loss.backward()
    grads = [x.grad, head.weight.grad] + ([head.bias.grad] if bias is not None else [])
    return loss.detach(), grads, len(calls)


@pytest.mark.parametrize("softcap,bias", [(None, False), (2.0, True)], ids=["plain", "softcap_bias"])
def test_liger_fused_linear_cross_entropy(softcap: float | None, bias: bool) -> None:
    assert liger_runs_on(torch.device("cpu")), "TRITON_INTERPRET=1 should let Liger's kernels run on CPU"
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 48, generator=gen)
    weight = 0.3 * torch.randn(301, 48, generator=gen)
    b = 0.3 * torch.randn(301, generator=gen) if bias else None
    targets = torch.randint(0, 301, (2, 37), generator=gen)
    targets[:, ::5] = -100
    num_items = int((targets != -100).sum()) + 3  # as the Trainer passes it under gradient accumulation
    plain = _loss_and_grads("plain", hidden, targets, weight, b, softcap, num_items)
    for kind in ("liger", "chunked"):
        loss, grads, head_calls = _loss_and_grads(kind, hidden, targets, weight, b, softcap, num_items)
        errors = {"loss": _rel(loss, plain[0])}
        errors |= {n: _rel(g, r) for n, g, r in zip("xwb", grads, plain[1], strict=False)}
        print(kind, softcap, bias, {k: f"{v:.1e}" for k, v in errors.items()})
        assert max(errors.values()) <= TOL, (kind, errors)
        assert (head_calls == 0) == (kind == "liger"), (kind, head_calls)  # Liger takes the weight, never the head


def _train_sp1(out_dir: str, fused: bool) -> dict:
    """In this process on position_ids-packed rows: SPTrainer(sp_size=1, fused_loss=True), or plain
    ``transformers.Trainer`` (``fused=False``); what ``harness.compare`` compares."""
    import transformers
    from transformers import DataCollatorWithFlattening

    from hf_sp_trainer import SPTrainer, TrainingArguments

    model = tiny_model("llama", intermediate_size=96)  # only the logits have VOCAB columns
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    common = quiet_args(out_dir, 3) | dict(per_device_train_batch_size=3, learning_rate=1e-3)
    common["remove_unused_columns"] = False
    data = dict(train_dataset=synthetic_dataset(9, seed=1), eval_dataset=synthetic_dataset(4, seed=2))
    data["data_collator"] = DataCollatorWithFlattening(return_position_ids=True)
    if fused:
        trainer = SPTrainer(model=model, args=TrainingArguments(sp_size=1, fused_loss=True, **common), **data)
    else:
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**common), **data)
    with train_head_calls() as calls:
        trainer.train()
    steps = logged_steps(trainer)
    return {
        "losses": [loss for loss, _ in steps],
        "grad_norms": [norm for _, norm in steps],
        "eval_loss": trainer.evaluate()["eval_loss"],  # loss only: fused (Liger) too
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "init": init,
        "train_head_calls": len(calls),
    }


@pytest.mark.dist
def test_trainer_with_liger_fused_loss(world2: dict, tmp_path) -> None:
    """SPTrainer(fused_loss=True) at sp 1 (this process) and sp 2 (the 2-rank world): Liger computes every training
    and loss-only evaluation loss (the LM head never runs in training), and the runs equal plain Trainer's (per-step
    loss, grad_norm, eval_loss, parameters; at sp 2 also predictions and test loss)."""
    runs = {
        "sp1": (_train_sp1(str(tmp_path / "ref"), fused=False), _train_sp1(str(tmp_path / "sp1"), fused=True)),
        "sp2": (train_case(LIGER_SP2, sp=False, out_dir=str(tmp_path / "ref2")), world2[LIGER_SP2.name]),
    }
    for name, (reference, got) in runs.items():
        assert "error" not in got, got["error"]
        diffs = compare(reference, got)
        print(f"liger_trainer_{name}", {k: f"{v:.1e}" for k, v in diffs.items()})
        assert_within(name, diffs, TOL)
        assert got["train_head_calls"] == 0, f"{name}: the LM head ran in training: the chunked torch loss, not Liger"
