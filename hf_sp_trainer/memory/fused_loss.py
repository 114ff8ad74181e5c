"""Fused chunked LM head + cross-entropy: the loss of a causal LM without its full ``[seq, vocab]`` logits.

``enable_fused_loss(model)`` patches the causal-LM instance (under PEFT: the base model) so that a forward called
with ``sp_fused_loss=True`` runs the backbone, then the LM head and the cross-entropy over chunks of tokens. Each
chunk is a non-reentrant checkpoint: its ``[chunk, vocab]`` logits are freed right after its loss is taken and
recomputed in backward, one chunk at a time. Calling the LM-head *module* per chunk (not its weight) keeps a LoRA
adapter on ``lm_head``, tied embeddings, FSDP2 and ZeRO-3 parameter gathering working as in the unfused forward.

The loss is exactly the model's own: token losses summed over labels other than -100 and divided by
``num_items_in_batch`` (their count when not given), with Gemma's ``final_logit_softcapping``, pre-shifted
``shift_labels`` honoured, and the logits upcast to fp32 before the cross-entropy, as ``ForCausalLMLoss`` does. The
trainer (``fused_loss_inputs``) asks for it only when no logits are returned: training steps, and evaluation with
``prediction_loss_only``. On CUDA with ``liger-kernel`` installed and a plain ``nn.Linear`` head, Liger's fused linear
cross-entropy is used instead.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

logger = logging.get_logger(__name__)

FUSED_KWARG = "sp_fused_loss"
IGNORE_INDEX = -100
# Config attributes of logit transforms the unfused forward applies and this loss does not (Cohere, Granite, ...).
_UNSUPPORTED_SCALES = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")
_logged: set[str] = set()


def _info_once(key: str, message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(message)


def check_fused_loss_model(model: nn.Module) -> None:
    """Refuse models whose forward computes its logits or loss in a way this loss would not reproduce."""
    config = model.config.get_text_config()
    if model.get_output_embeddings() is None:
        raise ValueError(f"fused_loss=True needs a causal LM with an LM head; {type(model).__name__} has none.")
    for attr in _UNSUPPORTED_SCALES:
        value = getattr(config, attr, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"fused_loss=True does not apply {config.model_type}'s {attr}={value} to the logits; set "
                "fused_loss=False for this model."
            )
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"fused_loss=True does not add the MoE router auxiliary loss (output_router_logits=True on "
            f"{config.model_type}); set fused_loss=False or output_router_logits=False."
        )


def enable_fused_loss(model: nn.Module) -> None:
    """Patch a causal LM (not its PEFT wrapper) so ``model(..., sp_fused_loss=True)`` returns the fused loss."""
    check_fused_loss_model(model)
    if getattr(model, "_sp_fused_loss", False):
        return
    original_forward = model.forward
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)

    # keeps the signature (with ``self``) that the Trainer inspects for its columns
    @functools.wraps(getattr(original_forward, "__func__", type(model).forward))
    def forward(self, *args, **kwargs):
        fused = kwargs.pop(FUSED_KWARG, False)
        if not fused or (kwargs.get("labels") is None and kwargs.get("shift_labels") is None):
            return original_forward(*args, **kwargs)
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        outputs = self.base_model(*args, **kwargs)
        hidden = outputs.last_hidden_state
        if shift_labels is None:  # as ForCausalLMLoss: position t predicts labels[t + 1], the last one nothing
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        head = self.get_output_embeddings()
        loss = fused_linear_cross_entropy(hidden, shift_labels, head, num_items_in_batch, softcap)
        return CausalLMOutputWithPast(
            loss=loss,
            past_key_values=getattr(outputs, "past_key_values", None),
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )

    model.forward = types.MethodType(forward, model)
    model._sp_fused_loss = True


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: nn.Module,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``sum CE(softcap(head(hidden)), targets) / num_items_in_batch`` (mean over non-ignored targets without it).

    ``hidden``: ``[..., hidden_size]``; ``targets``: the matching shape without the last dim, -100 ignored.
    ``chunk_tokens`` defaults to ``ceil(tokens / ceil(vocab / hidden_size))``: a chunk's logits are about as large as
    the hidden states.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    total = _liger_sum(hidden, targets, head, softcap)
    if total is None:
        vocab = getattr(head, "out_features", None) or getattr(head.weight, "ds_shape", head.weight.shape)[0]
        chunk = chunk_tokens or math.ceil(hidden.shape[0] / math.ceil(vocab / hidden.shape[1]))
        chunk = max(1, chunk)
        pieces = zip(hidden.split(chunk), targets.split(chunk), strict=True)
        if torch.is_grad_enabled():
            sums = [checkpoint(_chunk_loss, h, t, head, softcap, use_reentrant=False) for h, t in pieces]
        else:
            sums = [_chunk_loss(h, t, head, softcap) for h, t in pieces]
        total = torch.stack(sums).sum() if sums else hidden.sum() * 0
    if num_items_in_batch is None:
        return total / (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, softcap: float | None) -> torch.Tensor:
    logits = head(hidden)
    if softcap is not None:  # the same ops, in the same dtype, as Gemma's forward
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _liger_sum(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, softcap: float | None):
    """Liger's fused linear cross-entropy (summed) on CUDA for a plain ``nn.Linear`` head; ``None`` when not usable."""
    weight = getattr(head, "weight", None)
    plain = type(head) is nn.Linear and not isinstance(weight, DTensor) and not hasattr(weight, "ds_id")
    if hidden.device.type != "cuda" or not plain:
        why = "hidden states not on CUDA" if hidden.device.type != "cuda" else "the LM head is not a plain nn.Linear"
        _info_once(why, f"fused_loss: chunked torch cross-entropy ({why}).")
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        _info_once("no liger", "fused_loss: chunked torch cross-entropy (liger-kernel is not installed).")
        return None
    _info_once("liger", "fused_loss: Liger's fused linear cross-entropy.")
    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", softcap=softcap)
    out = loss_fn(weight, hidden, targets, head.bias)
    return out[0] if isinstance(out, tuple) else out


def fused_loss_inputs(trainer: Any, model: nn.Module, inputs: dict[str, Any], return_outputs: bool) -> dict[str, Any]:
    """The trainer's ``compute_loss`` inputs, asking for the fused loss when the caller needs no logits."""
    if not getattr(trainer, "_sp_fused_loss", False):
        return inputs
    if return_outputs and not getattr(trainer, "_sp_prediction_loss_only", False):
        return inputs
    return {**inputs, FUSED_KWARG: True}


def enable_trainer_fused_loss(trainer: Any) -> None:
    """The ``fused_loss`` branch of ``enable_memory_features``."""
    args = trainer.args
    import trl

    if isinstance(trainer, trl.SFTTrainer):
        _check_sft(trainer)
        return
    if args.label_smoothing_factor or trainer.compute_loss_func is not None:
        raise ValueError(
            f"fused_loss=True computes the model's own cross-entropy without the full logits; "
            f"label_smoothing_factor={args.label_smoothing_factor} and compute_loss_func="
            f"{trainer.compute_loss_func!r} need the logits. Set fused_loss=False or remove them."
        )
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    enable_fused_loss(model)
    trainer._sp_fused_loss = True


def _check_sft(trainer: Any) -> None:
    """TRL's SFTTrainer already computes its nll/dft loss with a fused, chunked LM head: nothing to patch."""
    args = trainer.args
    if args.label_smoothing_factor or trainer.compute_loss_func is not None:
        raise ValueError(
            f"fused_loss=True with SFTConfig: TRL computes the loss from the full logits when "
            f"label_smoothing_factor={args.label_smoothing_factor} or a compute_loss_func is given. Set "
            "fused_loss=False or remove them."
        )
    logger.info(f"fused_loss=True: TRL's SFTTrainer already computes its '{args.loss_type}' loss with a fused LM head.")


__all__ = ["FUSED_KWARG", "enable_fused_loss", "enable_trainer_fused_loss", "fused_linear_cross_entropy"]
