"""Fused chunked LM head + cross-entropy: the loss of a causal LM without its full ``[seq, vocab]`` logits.

``enable_fused_loss(model)`` patches the causal-LM instance's ``forward`` (under PEFT: the base model's), through the
patch registry, so that a forward with labels
that needs no logits runs the backbone, then the LM head and the cross-entropy over chunks of tokens. As in Liger's
patched forwards, ``skip_logits`` says whether logits are needed: by default not in training mode with labels (a
training step only uses the loss), and a loss-only evaluation passes ``skip_logits=True`` (``loss_only_inputs``). Each
chunk is a non-reentrant checkpoint: its ``[chunk, vocab]`` logits are freed right after its loss is taken and
recomputed in backward, one chunk at a time. Calling the LM-head *module* per chunk (not its weight) keeps a LoRA
adapter on ``lm_head``, tied embeddings, FSDP2 and ZeRO-3 parameter gathering working as in the unfused forward.

The loss is exactly the model's own: token losses summed over labels other than -100 and divided by
``num_items_in_batch`` (their count when not given), with Gemma's ``final_logit_softcapping``, pre-shifted
``shift_labels`` honoured, and the logits upcast to fp32 before the cross-entropy, as ``ForCausalLMLoss`` does.
On CUDA with ``liger-kernel`` installed and a plain ``nn.Linear`` head, Liger's fused linear cross-entropy is used
instead (also on CPU under Triton's interpreter, ``TRITON_INTERPRET=1``: the GPU-kernel test tier).
"""

from __future__ import annotations

import functools
import math
import os
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from .. import patches
from ..model.decoder import unwrap_peft
from ..sharding import IGNORE_INDEX
from ..sharding import shift_labels as shifted

logger = logging.get_logger(__name__)

SKIP_LOGITS = "skip_logits"
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
    """Patch a causal LM (not its PEFT wrapper) so that a forward with labels and ``skip_logits`` (default: in training
    mode) returns the fused loss and no logits. The instance's ``forward`` goes through the patch registry (held
    weakly: the record dies with the model), after checking that the model's own loss is the one computed here."""
    check_fused_loss_model(model)
    if has_fused_loss(model):
        return
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    patches.patch(
        model,
        "forward",
        wrap=functools.partial(_fused_forward, model, softcap),
        check=functools.partial(check_same_loss, model),
        reason="fused_loss: the LM head and cross-entropy over chunks of tokens, without the [seq, vocab] logits",
        fix="Set fused_loss=False for this model.",
        where=type(model).__name__,
    )


def _fused_forward(model: nn.Module, softcap: float | None, original_forward):
    # keeps the signature (with ``self``) that the Trainer inspects for its columns
    @functools.wraps(getattr(original_forward, "__func__", type(model).forward))
    def forward(self, *args, **kwargs):
        skip_logits = kwargs.pop(SKIP_LOGITS, None)
        has_labels = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        if not has_labels or not (self.training if skip_logits is None else skip_logits):
            return original_forward(*args, **kwargs)
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        outputs = self.base_model(*args, **kwargs)
        hidden = outputs.last_hidden_state
        if shift_labels is None:  # as ForCausalLMLoss: position t predicts labels[t + 1], the last one nothing
            shift_labels = shifted(labels)
        head = self.get_output_embeddings()
        loss = fused_linear_cross_entropy(hidden, shift_labels, head, num_items_in_batch, softcap)
        return CausalLMOutputWithPast(  # no cache: training and loss-only evaluation
            loss=loss,
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )

    return types.MethodType(forward, model)


def check_same_loss(model: nn.Module, forward=None) -> None:
    """The model's own loss (``model.loss_function``: transformers' ``ForCausalLMLoss``) equals the fused one on a
    small input: labels shifted by one, -100 ignored, summed over ``num_items_in_batch`` (the mean without it)."""
    _check_loss_function(model.loss_function)


@functools.cache
def _check_loss_function(loss_function) -> None:
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.utils.skip_init(nn.Linear, 4, 7, bias=False)  # no draw from the global RNG
    with torch.no_grad():
        head.weight.copy_(torch.randn(7, 4, generator=generator))
        hidden = torch.randn(2, 5, 4, generator=generator)
        labels = torch.randint(0, 7, (2, 5), generator=generator)
        labels[0, 3:] = IGNORE_INDEX
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        for count in (None, torch.tensor(11)):
            theirs = loss_function(logits=head(hidden), labels=labels, vocab_size=7, num_items_in_batch=count)
            ours = fused_linear_cross_entropy(hidden, shifted, head, count, chunk_tokens=3)
            if not torch.allclose(theirs.float(), ours.float(), atol=1e-6):
                raise ValueError(
                    f"the model's loss ({getattr(loss_function, '__name__', loss_function)}) is not the causal-LM "
                    f"cross-entropy fused_loss computes ({float(theirs)} vs {float(ours)})"
                )


def has_fused_loss(model: nn.Module) -> bool:
    """Whether ``model`` (or the causal LM under its PEFT wrapper) computes the fused loss."""
    model = getattr(model, "module", model)  # DDP / DeepSpeed engine
    model = unwrap_peft(model)
    return patches.find(model, "forward") is not None


def loss_only_inputs(model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs of a forward whose logits are not needed (a loss-only evaluation): the fused loss, if enabled."""
    return {**inputs, SKIP_LOGITS: True} if has_fused_loss(model) else inputs


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


def liger_runs_on(device: torch.device) -> bool:
    """Whether Liger's Triton kernels can run on ``device``: CUDA, or the CPU under Triton's interpreter
    (``TRITON_INTERPRET=1``, set before Python starts)."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _liger_sum(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, softcap: float | None):
    """Liger's fused linear cross-entropy (summed) where it runs (``liger_runs_on``) for a plain ``nn.Linear`` head;
    ``None`` when not usable."""
    weight = getattr(head, "weight", None)
    plain = type(head) is nn.Linear and not isinstance(weight, DTensor) and not hasattr(weight, "ds_id")
    runs = liger_runs_on(hidden.device)
    if not runs or not plain:
        why = "hidden states not on CUDA" if not runs else "the LM head is not a plain nn.Linear"
        _info_once(why, f"fused_loss: chunked torch cross-entropy ({why}).")
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        _info_once("no liger", "fused_loss: chunked torch cross-entropy (liger-kernel is not installed).")
        return None
    _info_once("liger", "fused_loss: Liger's fused linear cross-entropy.")
    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", softcap=softcap)
    out = loss_fn(lin_weight=weight, _input=hidden, target=targets, bias=head.bias)  # by name: liger-kernel 0.8.5's
    return out[0] if isinstance(out, tuple) else out


def log_fused_by_trainer(args) -> None:
    """``fused_loss`` with a trainer whose loss is already fused (TRL's SFTTrainer): nothing to patch."""
    loss_type = getattr(args, "loss_type", "nll")
    logger.info(f"fused_loss=True: the trainer's '{loss_type}' loss already uses a fused LM head.")


__all__ = [
    "enable_fused_loss",
    "fused_linear_cross_entropy",
    "has_fused_loss",
    "log_fused_by_trainer",
    "loss_only_inputs",
]
