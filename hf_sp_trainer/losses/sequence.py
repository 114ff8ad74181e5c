"""The exact loss under sequence parallelism.

Training: each rank sums the token losses of its shard (pre-shifted ``shift_labels``, so no token loses its target
at a shard boundary) and divides by the token count of the whole optimizer step (``num_items_in_batch``, counted once
per SP group by the mixin); DDP / FSDP / ZeRO then average over every rank, which the Trainer compensates as for any
data-parallel run. Loss and gradients equal the single-device ones; a shard without labels contributes 0, not NaN.

Evaluation: the batch's loss is the mean over its tokens, i.e. over the whole SP group, as on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..model.decoder import unwrap_peft
from ..sharding import IGNORE_INDEX


def check_loss_options(trainer: Any) -> None:
    """The one place that refuses loss options SP and the fused loss can't reproduce exactly (before any collective)."""
    args = trainer.args
    switches = (("sequence parallelism", args.sp_size > 1), ("fused_loss", getattr(args, "fused_loss", False)))
    features = [name for name, on in switches if on]
    if not features:
        return
    custom = []
    if args.label_smoothing_factor:
        custom.append(f"label_smoothing_factor={args.label_smoothing_factor}")
    if trainer.compute_loss_func is not None:
        custom.append(f"compute_loss_func={trainer.compute_loss_func!r}")
    if custom:
        raise ValueError(
            f"{' and '.join(features)} computes the model's own cross-entropy exactly (from pre-shifted shift_labels "
            f"and the step's token count, without full logits for fused_loss); {', '.join(custom)} is not supported "
            "with it. Remove it, or set sp_size=1 and fused_loss=False."
        )
    if args.sp_size > 1 and not trainer.model_accepts_loss_kwargs and not passes_loss_kwargs(trainer.model):
        raise ValueError(
            f"sp_size={args.sp_size} needs a model whose forward takes the loss kwargs (shift_labels, "
            f"num_items_in_batch); {type(trainer.model).__name__}'s does not."
        )


def passes_loss_kwargs(model) -> bool:
    """The forward hands its ``**kwargs`` to ``self.loss_function`` (the Qwen-VL family does, though it sets
    ``accepts_loss_kwargs = False`` so that the Trainer averages its loss per micro-batch).

    Read from the forward's code, not checked by behaviour: a behaviour check would run the whole model's forward at
    trainer construction with ``loss_function`` (a property of every transformers model) intercepted, before ZeRO-3
    / FSDP2 have placed the weights. A wrong answer refuses the model (``check_loss_options``), it never trains
    differently; tests/test_multimodal.py checks the Qwen-VL losses exact under SP."""
    import ast
    import inspect
    import textwrap

    model = unwrap_peft(model)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "loss_function"
        and any(k.arg is None for k in n.keywords)
        for n in ast.walk(tree)
    )


def micro_batch_loss(trainer: Any, compute_loss: Callable, model, inputs: dict, return_outputs: bool):
    """Training loss under SP for a model the Trainer averages per micro-batch (``accepts_loss_kwargs = False``):
    this rank's token-loss sum over the whole SP group's token count, times ``sp_size`` (the gradient average over
    the SP group divides it back); the Trainer then divides by the accumulation steps as it does on one device."""
    topo = trainer.sp.topology
    count = (inputs["shift_labels"] != IGNORE_INDEX).sum()
    dist.all_reduce(count, group=topo.sp_group)
    count = count.clamp(min=1)
    result = compute_loss(model, {**inputs, "num_items_in_batch": count}, return_outputs, num_items_in_batch=count)
    loss, outputs = result if return_outputs else (result, None)
    # x world (dp x sp) by the base trainer, or nothing: either way x sp in the end
    loss = loss / topo.dp_size if trainer.sp_loss_scaled_by_world() else loss * topo.sp_size
    return (loss, outputs) if return_outputs else loss


def sp_eval_loss(trainer: Any, compute_loss: Callable, model, inputs: dict, return_outputs: bool):
    """An evaluation batch's loss under SP: the mean over the tokens of the whole SP group (``num_items_in_batch`` of
    training mixes the batches of different DP ranks)."""
    group = trainer.sp.topology.sp_group
    count = (inputs["shift_labels"] != IGNORE_INDEX).sum()
    dist.all_reduce(count, group=group)
    if not trainer.model_accepts_loss_kwargs:  # the Trainer won't pass it on: the model gets it directly
        inputs = {**inputs, "num_items_in_batch": count.clamp(min=1)}
    result = compute_loss(model, inputs, return_outputs, num_items_in_batch=count.clamp(min=1))
    loss, outputs = result if return_outputs else (result, None)
    if trainer.sp_loss_scaled_by_world():  # undo the base trainer's x DDP: this loss is not backpropagated
        loss = loss / (trainer.accelerator.num_processes // trainer.get_tp_size())
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return (loss, outputs) if return_outputs else loss
