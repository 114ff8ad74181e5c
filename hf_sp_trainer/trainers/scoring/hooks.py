"""Forward hooks that run a preference trainer's model calls under sequence parallelism.

TRL's DPO and KTO trainers score sequences with ``model(input_ids, attention_mask, labels=..., fused_lm_head=True)``
(per-token log-probabilities from TRL's fused LM head, never the full logits); the reward trainer reads a
sequence-classification model's score at each sequence's last token. Both stay TRL's own code: a pre-hook on the
transformers model packs the full padded batch into this rank's shard (``layout.pack_and_shard``), the model runs on
the shard (its attention is SP's), and a post-hook scatters the shard's per-token (or last-token) results into the
batch's output grid and sums it over the SP group (``sequence_all_reduce``, differentiable). Every rank then holds
exactly the outputs of the unsharded forward, so every sequence-level term TRL builds from them (summed log-probs,
length-normalised and ``ld_alpha`` variants, WPO weights, rewards, KL estimates, metrics) is exact. The reduced tensors
are O(tokens) scalars, gathered with one collective per forward; logits are never gathered. An MoE policy's
load-balancing loss comes back as the whole batch's value (``losses/router.py``), with the gradient convention of the
reduced log-probs (``LogProbHooks.aux_loss``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...comm.reduce import sequence_all_reduce
from ...losses.router import RouterLoss
from ...model.vlm import rope_index, uses_mrope, vlm_base
from ...parallel import SequenceParallel
from ...sharding import MEDIA_KEYS
from .layout import PackedShard, last_token_slots, pack_and_shard, real_token_mask, scatter_to_grid, token_slots

_LOGPROB_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
_BOOL_FIELDS = ("is_top1", "label_mask")
_PASSED_THROUGH = ("input_ids", "attention_mask", "labels", "use_cache", "fused_lm_head", "num_items_in_batch")
TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")  # a VLM's per-token types: packed like input_ids


def _split_kwargs(model: nn.Module, args: tuple, kwargs: dict[str, Any], router_logits: bool = False) -> dict[str, Any]:
    """The kwargs besides the token tensors; refuses positional inputs, other per-token tensors and (unless
    ``router_logits``) ``output_router_logits``."""
    if args:
        raise ValueError(f"Under sequence parallelism, call {type(model).__name__} with keyword arguments only.")
    seq = kwargs["input_ids"].shape[1]
    others = {k: v for k, v in kwargs.items() if k not in (*_PASSED_THROUGH, *TOKEN_TYPE_KEYS)}
    per_token = [
        k for k, v in others.items() if torch.is_tensor(v) and v.ndim >= 2 and v.shape[1] == seq and k not in MEDIA_KEYS
    ]
    if per_token or (others.get("output_router_logits") and not router_logits):
        raise ValueError(
            f"Sequence parallelism does not shard {per_token or ['output_router_logits']} in preference training "
            "(per-token inputs besides the tokens and their types, MoE router logits). Use sp_size=1."
        )
    return others  # media (pixel values, grids) pass whole: the VLM's media pre-hook picks each rank's rows


class _Hooks:
    column_positions = False  # GRPO/RLOO: positions are column indices (left-padded prompts)

    def __init__(self, sp: SequenceParallel, pad_token_id: int) -> None:
        self.sp = sp
        self.pad_token_id = pad_token_id
        self.pending: PackedShard | None = None
        self.handles: list[Any] = []
        self.router_loss: RouterLoss | None = None  # the policy's (set by the trainer): its aux loss is returned

    def attach(self, model: nn.Module) -> None:
        self.rope_base = vlm_base(model) if uses_mrope(model) else None  # Qwen-VL / GLM-4V: positions per row
        self.handles += [
            model.register_forward_pre_hook(self.before, with_kwargs=True),
            model.register_forward_hook(self.after, with_kwargs=True),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def shard(self, kwargs, slots, grid, labels=None) -> PackedShard:
        topo = self.sp.topology
        return pack_and_shard(
            self.sp.sharding,
            topo.sp_rank,
            kwargs["input_ids"],
            kwargs.get("attention_mask"),
            slots,
            grid,
            labels,
            self.pad_token_id,
            column_positions=self.column_positions,
            token_types={k: kwargs[k] for k in TOKEN_TYPE_KEYS if kwargs.get(k) is not None},
            rope_positions=self.rope_positions(kwargs),
        )

    def rope_positions(self, kwargs) -> torch.Tensor | None:
        """A multimodal-rope VLM's positions of the padded rows, as its own forward computes them there (only when
        the batch has media grids; else it counts each row 0, 1, ... like the text row)."""
        if self.rope_base is None or all(kwargs.get(k) is None for k in ("image_grid_thw", "video_grid_thw")):
            return None
        if kwargs.get("mm_token_type_ids") is None:
            raise ValueError(
                f"{type(self.rope_base).__name__} got media grids without mm_token_type_ids: its multimodal rotary "
                "positions need them. Use a processor that returns them (transformers' Qwen-VL / GLM-4V processors)."
            )
        return rope_index(self.rope_base, kwargs["input_ids"], kwargs, kwargs.get("attention_mask"))

    def reduce(self, local: torch.Tensor, packed: PackedShard) -> torch.Tensor:
        full = scatter_to_grid(local, packed.slots, packed.grid)
        return sequence_all_reduce(full, self.sp.topology.sp_group).view(*packed.grid, *local.shape[1:])

    def take_pending(self) -> PackedShard:
        packed, self.pending = self.pending, None
        if packed is None:
            raise RuntimeError("Sequence-parallel post-forward hook ran without its pre-forward hook.")
        return packed


class LogProbHooks(_Hooks):
    """For a causal LM given TRL's fused LM head: ``fused_lm_head=True`` calls on full padded batches."""

    def before(self, module, args, kwargs):
        if not kwargs.get("fused_lm_head"):
            raise ValueError(
                f"Under sequence parallelism the preference trainers run {type(module).__name__} only through TRL's "
                "fused log-probability forward (fused_lm_head=True); a plain forward (logits, generation, "
                "compute_metrics) is not supported. Set sp_size=1 for it."
            )
        others = _split_kwargs(module, args, kwargs, router_logits=True)
        rows, seq = kwargs["input_ids"].shape
        slots = token_slots(rows, seq, kwargs["input_ids"].device)
        self.pending = self.shard(kwargs, slots, (rows, seq - 1), labels=kwargs["labels"])
        return (), {**others, **self.pending.inputs, "fused_lm_head": True, "use_cache": False}

    def after(self, module, args, kwargs, output):
        packed = self.take_pending()
        aux = self.aux_loss(output)
        names = [n for n in _LOGPROB_FIELDS if getattr(output, n, None) is not None]
        dtype = output.log_probs.dtype
        local = torch.stack([getattr(output, n)[0].to(dtype) for n in names], dim=-1)  # [local_len, fields]
        full = self.reduce(local, packed)
        fields = {n: full[..., i] > 0.5 if n in _BOOL_FIELDS else full[..., i] for i, n in enumerate(names)}
        count = fields["label_mask"].sum() if "label_mask" in fields else packed.grid[0]
        loss = -fields["log_probs"].sum() / (count.clamp(min=1) if torch.is_tensor(count) else count)
        return type(output)(loss=loss, **fields, **({} if aux is None else {"aux_loss": aux}))

    def aux_loss(self, output) -> torch.Tensor | None:
        """The policy's MoE load-balancing loss of the whole batch (the same on every SP rank), or ``None`` where
        the forward computed none or it is another model's (the reference's: TRL discards it).

        Every rank builds TRL's loss ``L`` from the same whole-batch terms; the group's objective is their sum
        ``sp x L`` and the data-parallel backends average gradients over the group. The reduced log-probs take that
        sum's gradient (``reduce.py``: ``sp x dL/dy`` on each rank's own tokens); so does this term: ``value``, with
        the gradient of ``sp x`` this rank's share (the shares sum to ``value``), averages to ``d value``.
        """
        recorded = self.router_loss.take() if self.router_loss is not None else None
        if getattr(output, "aux_loss", None) is None or self.router_loss is None:
            return None
        if recorded is None:
            raise RuntimeError("The model computed an MoE router loss that sequence parallelism did not record.")
        share, value = recorded
        return value + self.sp.topology.sp_size * (share - share.detach())


class RewardHooks(_Hooks):
    """For a sequence-classification model: its score read at each sequence's last non-pad token."""

    def attach(self, model: nn.Module) -> None:
        heads = [getattr(model, n, None) for n in ("score", "classifier")]
        head = next((h for h in heads if isinstance(h, nn.Module)), None)
        if head is None:
            raise ValueError(
                f"Sequence parallelism reads {type(model).__name__}'s score at the last token through its `score` "
                "(or `classifier`) head; this model has neither. Use a transformers *ForSequenceClassification model."
            )
        super().attach(model)
        self.handles.append(head.register_forward_hook(self.keep_head_output))
        self.head_output: torch.Tensor | None = None

    def keep_head_output(self, module, args, output):
        self.head_output = output

    def before(self, module, args, kwargs):
        others = _split_kwargs(module, args, kwargs)
        input_ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        slots = last_token_slots(input_ids, module.config.get_text_config().pad_token_id)
        if int((slots[real_token_mask(input_ids, mask)] >= 0).sum()) != input_ids.shape[0]:
            raise ValueError("A sequence's last non-pad token lies in its padding; check pad_token_id and the mask.")
        self.pending = self.shard(kwargs, slots, (input_ids.shape[0],))
        return (), {**others, **self.pending.inputs, "use_cache": False}

    def after(self, module, args, kwargs, output):
        packed = self.take_pending()
        local, self.head_output = self.head_output[0], None  # [local_len, num_labels]
        return type(output)(logits=self.reduce(local, packed))
