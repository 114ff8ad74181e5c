"""Ulysses sequence parallelism as a transformers attention backend.

Each rank holds ``s/P`` tokens of every sequence. Before attention an all-to-all turns ``[b, h, s/P, d]`` into
``[b, h/P, s, d]``; the inner kernel runs on the full sequence for this rank's heads; a second all-to-all turns
``[b, s, h/P, d]`` back into ``[b, s/P, h, d]``. Document boundaries come from the ``position_ids`` of the whole
sequence, gathered once per forward step by a pre-hook on the decoder.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
from transformers import AttentionInterface, PreTrainedModel

from .all_to_all import all_gather_along, all_to_all
from .kernels import resolve_kernel, run_kernel
from .layout import DocumentLayout

ULYSSES_KEY = "ulysses_sp"  # must contain neither "flash" nor "sdpa": those trigger special loading paths
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> its gathering pre-hook


class _KVGroupsView:
    """The attention module seen with another number of query heads per kv head (after kv replication)."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int):
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def head_counts(config) -> tuple[int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads


def kv_replication(num_kv_heads: int, sp_size: int) -> int:
    """How often each kv head is repeated so that the kv heads split evenly over ``sp_size`` ranks."""
    return math.lcm(num_kv_heads, sp_size) // num_kv_heads


def validate_model_for_sp(model: PreTrainedModel, sp_size: int) -> None:
    """Raise a ``ValueError`` (the same on every rank, before any collective) if ``model`` can't run Ulysses SP."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{name} computes attention without the transformers attention registry (AttentionInterface), so "
            f"sequence parallelism (sp_size={sp_size}) can't be plugged in. Use a model whose class sets "
            "`_supports_attention_backend = True` (Llama, Qwen2/3, Mistral, Gemma, Phi3, ...) or sp_size=1."
        )
    heads, kv_heads = head_counts(model.config)
    if heads % sp_size != 0 or heads % kv_heads != 0:
        raise ValueError(
            f"{name} ({model.config.model_type}) has {heads} attention heads and {kv_heads} key/value heads: "
            f"the {heads} query heads can't be split evenly over sp_size={sp_size} ranks. Choose an sp_size that "
            f"divides {heads} (e.g. {[d for d in range(2, heads + 1) if heads % d == 0][:4]})."
        )
    if any(getattr(m, "sinks", None) is not None for m in model.modules()):
        raise ValueError(
            f"{name} uses attention sinks (a learned per-head logit); Ulysses SP does not slice them per head yet. "
            "Use sp_size=1 for this model."
        )


class UlyssesAttention:
    """The attention function registered under ``ULYSSES_KEY`` (one per process: the last one attached)."""

    def __init__(self, group: dist.ProcessGroup, kernel: str):
        self.group = group
        self.kernel = kernel
        self.sp_size = dist.get_world_size(group)
        self.sp_rank = dist.get_rank(group)
        self.layout: DocumentLayout | None = None

    # -- the attention function -------------------------------------------------------------------------------
    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if self.layout is None:
            raise RuntimeError("Ulysses attention was called outside a forward of the model it was attached to.")
        rep = kv_replication(key.shape[1], self.sp_size)
        if rep > 1:  # e.g. 2 kv heads on 4 ranks: each rank needs its query heads' kv head
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        q, k, v = (all_to_all(t, scatter_dim=1, gather_dim=2, group=self.group) for t in (query, key, value))
        fn = resolve_kernel(self.kernel, module)
        kernel_module = module if rep == 1 else _KVGroupsView(module, q.shape[1] // k.shape[1])
        out = run_kernel(self.kernel, fn, kernel_module, q, k, v, self.layout, kwargs)  # [b, s, h/P, d]
        return all_to_all(out, scatter_dim=1, gather_dim=2, group=self.group), None  # [b, s/P, h, d]

    # -- wiring into a model ----------------------------------------------------------------------------------
    def attach(self, model: PreTrainedModel) -> None:
        """Route ``model``'s attention through this backend and gather document boundaries once per forward."""
        validate_model_for_sp(model, self.sp_size)
        if self.kernel == ULYSSES_KEY:
            raise ValueError(f"The inner attention kernel can't be {ULYSSES_KEY!r} itself: set sp_attn_implementation.")
        model.set_attn_implementation(self.kernel)  # transformers validates the inner kernel (installed, GPU, ...)
        AttentionInterface.register(ULYSSES_KEY, self)
        model.set_attn_implementation(ULYSSES_KEY)
        decoder = getattr(model, model.base_model_prefix, model)
        if decoder in _HOOKS:  # attached before (e.g. a second trainer on the same model): replace the old hook
            _HOOKS[decoder].remove()
        _HOOKS[decoder] = decoder.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def _before_forward(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = input_ids if input_ids is not None else kwargs["inputs_embeds"]
        batch, local_len = tokens.shape[:2]
        mask = kwargs.get("attention_mask")
        has_padding = mask is not None and not bool(mask.bool().all())
        # One small collective every rank always completes, so a bad input raises everywhere instead of hanging.
        shapes = all_gather_along(
            torch.tensor([[batch, local_len, int(has_padding)]], device=tokens.device), 0, self.group
        ).tolist()
        if any(row[:2] != shapes[0][:2] for row in shapes):
            raise ValueError(
                "Sequence-parallel ranks received shards of different shapes [batch, local_len]: "
                f"{[row[:2] for row in shapes]}. Every rank of an SP group must get the same batch, split into equal "
                "shards (SPTrainer pads the sequence to a multiple of sp_size)."
            )
        if any(row[2] for row in shapes):
            raise ValueError(
                "An attention_mask with padding zeros was passed under sequence parallelism; padded batches are not "
                "supported. Pack examples with position_ids instead (hf_sp_trainer.SPDataCollator)."
            )
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            start = self.sp_rank * local_len
            position_ids = torch.arange(start, start + local_len, device=tokens.device).unsqueeze(0)
        position_ids = position_ids.expand(batch, -1)
        self.layout = DocumentLayout.from_position_ids(all_gather_along(position_ids, 1, self.group))
        kwargs.update(position_ids=position_ids, attention_mask=None, use_cache=False)
        return args, kwargs
