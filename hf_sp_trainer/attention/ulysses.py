"""Sequence parallelism as a transformers attention backend: Ulysses, and Ulysses x Ring.

Each rank holds ``s/P`` tokens of every sequence. Before attention an all-to-all over the Ulysses group (``U``
ranks) turns ``[b, h, s/P, d]`` into ``[b, h/U, s/R, d]``: this rank's heads over its ring portion (the whole
sequence when the ring size ``R`` is 1). The inner kernel runs on the whole sequence (``R == 1``), or ring attention
passes K/V blocks around the ring group (``R > 1``); a second all-to-all turns ``[b, s/R, h/U, d]`` back into
``[b, s/P, h, d]``. Document boundaries come from the ``position_ids`` of the whole sequence, gathered once per
forward step by a pre-hook on the decoder. The top-k selecting attentions (DSA and its kin, MiniMax-M3's blocks)
take the all-gather path with a ring instead: the ring group's K/V gathered in sequence order (``dsa.ring_gather``).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from ..comm import all_to_all, all_to_all_many
from ..documents import BOUNDS_KWARG, SP_KWARG, DocumentHook, detach_documents, document_bounds, relay_sp_kwargs
from ..model.heads import attention_shapes
from ..model.vlm import encoder_config_keys, image_block_rule, is_multimodal, text_decoder
from ..sharding import SequenceSharding
from ..sharding.image_blocks import IMAGE_BLOCKS_KWARG, IMAGE_BLOCKS_MARK, mark_image_block_layers
from ..topology import SPTopology
from .block_sparse import BLOCKS_KWARG, block_selected_attention
from .dsa import INDICES_KWARG, ring_gather, selected_attention
from .kernels import is_varlen_kernel, resolve_kernel, run_kernel
from .position_rules import (
    CHUNK_MARK,
    WholeSequenceRope,
    chunk_layout,
    mark_position_rules,
    module_window,
    retune_temperature,
)
from .ring import autocast_like_sdpa, ring_attention

ULYSSES_KEY = "ulysses_sp"  # must contain neither "flash" nor "sdpa": those trigger special loading paths
_KEYS = itertools.count()  # each attached model gets its own registry key, ``ulysses_sp_<n>``
VARLEN_KEY = "varlen"  # torch's own varlen flash attention (CUDA): one kernel call per layer for all documents
DECODER_MARK = "_hf_sp_text_decoder"  # set on every module of a text decoder SP is attached to (survives deepcopy)


class _KVGroupsView:
    """The attention module seen with another number of query heads per kv head (after kv replication) and with
    this rank's slice of its attention sinks (eager kernels read ``module.sinks``)."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int, sinks: torch.Tensor | None = None):
        self._module = module
        self.num_key_value_groups = num_key_value_groups
        self.sinks = sinks

    def __getattr__(self, name):
        return getattr(self._module, name)


def kv_replication(num_kv_heads: int, sp_size: int) -> int:
    """How often each kv head is repeated so that the kv heads split evenly over ``sp_size`` ranks."""
    return math.lcm(num_kv_heads, sp_size) // num_kv_heads


def check_no_per_token_kwargs(module, local_len: int, kwargs: dict) -> None:
    """Refuse a score-shaped tensor kwarg over this rank's tokens (a bias such as inkling's ``position_bias``
    ``[b, h, q, kv]``): SP can't shard what it doesn't know, and dropping it would be silently wrong. Raised on every
    rank at the same layer, so nothing hangs. (Per-token ``[b, s]`` kwargs the model's forward passes on to every
    layer, e.g. ``shift_labels``, don't reach the attention's arithmetic; nor do ``position_ids``, ``[3, b, s]`` in
    GLM-4.5V, whose document bounds SP takes from the whole row's positions.)"""
    for name, value in kwargs.items():
        if name != "position_ids" and torch.is_tensor(value) and value.ndim >= 3 and local_len in value.shape[-2:]:
            raise ValueError(
                f"{type(module).__name__} passes {name} of shape {tuple(value.shape)} to its attention: a per-token "
                "tensor sequence parallelism can't shard. Use sp_size=1 for this model."
            )


def _sinks(module, kwargs: dict, heads: int) -> torch.Tensor | None:
    """The module's per-head sinks (``s_aux`` or ``module.sinks``), checked against its ``heads`` query heads."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"attention sinks of shape {tuple(sinks.shape)} for {heads} query heads; need ({heads},)")
    return sinks


class UlyssesAttention:
    """SP attention for one model, registered in transformers' attention registry under a key of its own
    (``ULYSSES_KEY`` + a number), so models with different splits share one process; its decoder pre-hook
    (``documents``) gathers the documents once per forward.

    All-to-all over the Ulysses group, then the inner kernel over the whole sequence (``ring == 1``) or ring attention
    over the ring group for this rank's ring portion, then the inverse all-to-all.
    """

    def __init__(self, topology: SPTopology, sharding: SequenceSharding, kernel: str):
        self.topology, self.sharding, self.kernel = topology, sharding, kernel
        self.documents = DocumentHook(topology, sharding)  # this forward's documents and local positions
        self.key = f"{ULYSSES_KEY}_{next(_KEYS)}"

    def registered(self, module, query, key, value, attention_mask, **kwargs):
        """The function under ``self.key``: the output contiguous, as transformers' own kernels return it (the
        inverse all-to-all gives a strided view; JetMoE and AfMoE ``.view`` it), and the module's own
        ``sliding_window`` passed where the model puts it only in the mask SP drops (Qwen2-MoE, PhiMoE)."""
        kwargs.pop(SP_KWARG, None)  # the hybrid mixers' context: not the inner kernels' business
        if not getattr(module, DECODER_MARK, False):  # e.g. a VLM's vision tower reached by a shared sub-config key
            raise RuntimeError(
                f"SP attention was called by {type(module).__name__}, which is not part of a text decoder SP was "
                "attached to; encoders must keep their own attention kernel."
            )
        if kwargs.get(BOUNDS_KWARG) is None or self.documents.layout is None:
            raise RuntimeError("SP attention was called outside a forward of the model it was attached to.")
        if "sliding_window" not in kwargs and module_window(module):  # an explicit None stays
            kwargs["sliding_window"] = module_window(module)
        out, weights = self(module, query, key, value, attention_mask, **kwargs)
        return out.contiguous(), weights

    # -- the attention function -------------------------------------------------------------------------------
    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        bounds = kwargs.pop(BOUNDS_KWARG)  # the whole sequence's documents, from the decoder pre-hook
        blocks = kwargs.pop(IMAGE_BLOCKS_KWARG, None)  # Gemma3's / Gemma4's images, from the media pre-hook
        indices = kwargs.pop(INDICES_KWARG, None)  # DSA's top-k keys per query, whole sequence (``dsa.dsa_forward``)
        selected_blocks = kwargs.pop(BLOCKS_KWARG, None)  # MiniMax-M3's blocks per query and KV group (block_sparse)
        if not getattr(module, IMAGE_BLOCKS_MARK, False):  # Gemma4's full-attention layers: causal throughout
            blocks = None
        topo = self.topology
        group = topo.ulysses_group
        check_no_per_token_kwargs(module, query.shape[2], kwargs)
        if key.shape[-1] != query.shape[-1] or value.shape[:3] != key.shape[:3]:
            raise ValueError(
                f"SP attention got q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}: k needs q's "
                "head dim, v k's batch, heads and length (its head dim may differ: MLA)"
            )
        layout = chunk_layout(self.documents.layout, getattr(module, CHUNK_MARK, None))  # Llama-4's chunks: documents
        if layout is not self.documents.layout:
            bounds = layout.cached("bounds", lambda: document_bounds(layout.segments, layout.position_ids.shape[1]))
        query = retune_temperature(module, query, self.documents.positions)  # Llama-4's NoPE temperature
        sinks = _sinks(module, kwargs, query.shape[1])
        if sinks is not None:  # rank u gets query heads [u * h/U, (u+1) * h/U); slice the materialised parameter
            chunk = query.shape[1] // topo.ulysses_size
            sinks = sinks[topo.ulysses_rank * chunk : (topo.ulysses_rank + 1) * chunk]
            kwargs["s_aux"] = sinks
        rep = kv_replication(key.shape[1], topo.ulysses_size)
        if rep > 1:  # e.g. 2 kv heads on 4 ranks: each rank needs its query heads' kv head
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        query, key, value = autocast_like_sdpa(query, key, value)
        q, k, v = all_to_all_many((query, key, value), scatter_dim=1, gather_dim=2, group=group)  # one collective
        # [b, h/U, s/R, d]: this rank's heads over its ring portion (the whole sequence without a ring)
        queries = None  # the selecting attentions with a ring: the ring group's K/V gathered, this portion's queries
        if (indices is not None or selected_blocks is not None) and topo.ring_size > 1:
            order = self.sharding.order(q.shape[2] * topo.ring_size)
            (k, v), queries = ring_gather((k, v), topo.ring_group, topo.ring_rank, order)
        if indices is not None:  # DSA (QSA, pooled DSA): each query's selected keys
            scale = kwargs.get("scaling") or q.shape[-1] ** -0.5
            dropout = kwargs.get("dropout", 0.0)
            out = selected_attention(q, k, v, indices, bounds, scale, dropout, sinks, queries=queries)
        elif selected_blocks is not None:  # MiniMax-M3: this rank's heads' groups' blocks
            scale = kwargs.get("scaling") or q.shape[-1] ** -0.5
            first = topo.ulysses_rank * q.shape[1]
            out = block_selected_attention(
                q, k, v, selected_blocks, module.indexer.block_size, query.shape[1], first, bounds, scale,
                kwargs.get("dropout", 0.0), queries,
            )  # fmt: skip
        elif blocks is not None or self._uses_blocks(q, kwargs, sinks is not None):  # one op: all documents, the ring
            ring = topo.ring_group if topo.ring_size > 1 else None
            out = ring_attention(
                q,
                k,
                v,
                bounds,
                ring,
                scale=kwargs.get("scaling") or q.shape[-1] ** -0.5,
                sliding_window=kwargs.get("sliding_window"),
                softcap=kwargs.get("softcap"),
                kernel=self.kernel,
                dropout=kwargs.get("dropout", 0.0),
                sinks=sinks,
                image_blocks=blocks,  # Gemma3: each image's pairs p < j, their own blocks of the plan
            )
        else:  # the registered kernel itself, per document / varlen / block mask
            fn = resolve_kernel(self.kernel, module)
            view = rep > 1 or sinks is not None
            kernel_module = _KVGroupsView(module, q.shape[1] // k.shape[1], sinks) if view else module
            dv = v.shape[-1]
            if is_varlen_kernel(self.kernel) and dv != q.shape[-1]:  # flash kernels: one head size (zero columns)
                kwargs["scaling"] = kwargs.get("scaling") or q.shape[-1] ** -0.5  # not the padded head size's
                v = F.pad(v, (0, max(q.shape[-1], dv) - dv))
                q, k = (F.pad(t, (0, v.shape[-1] - t.shape[-1])) for t in (q, k))
            out = run_kernel(self.kernel, fn, kernel_module, q, k, v, layout, kwargs)[..., :dv]  # [b,s,h/U,dv]
        return all_to_all(out, scatter_dim=1, gather_dim=2, group=group), None  # [b, s/P, h, d]

    def _uses_blocks(self, q: torch.Tensor, kwargs: dict, sinks: bool = False) -> bool:
        """The block kernels with their LSE: always with a ring; without one, for ``varlen`` and for sdpa on CPU (the
        fused CPU kernel sdpa itself calls, one op for all documents) or with sinks (sdpa has none); otherwise the
        registered kernel itself."""
        if self.topology.ring_size > 1 or self.kernel == VARLEN_KEY:
            return True
        cpu_fused = q.device.type == "cpu" and not kwargs.get("dropout")
        return self.kernel == "sdpa" and (sinks or cpu_fused)  # sinks with dropout: the ring's ValueError

    # -- wiring into a model ----------------------------------------------------------------------------------
    def attach(self, model: PreTrainedModel) -> None:
        """Route ``model``'s attention through this backend and gather document boundaries once per forward."""
        if attention_shapes(model.config):  # else a pure state-space model: documents and mixers only
            # transformers validates the inner kernel (installed, GPU, ...); torch's varlen is ours, with sdpa's setup
            model.set_attn_implementation(_text_only(model, self._inner_key))
            AttentionInterface.register(self.key, self.registered)
            model.set_attn_implementation(_text_only(model, self.key))
        for m in text_decoder(model).modules():
            setattr(m, DECODER_MARK, True)
        mark_image_block_layers(text_decoder(model), image_block_rule(model))
        mark_position_rules(text_decoder(model), model.config.get_text_config())
        rope = WholeSequenceRope(self.topology.sp_group).attach(text_decoder(model))  # dynamic NTK, longrope
        relays = relay_sp_kwargs(text_decoder(model))  # Nemotron, StableLM: attention called without **kwargs
        self.documents.attach(model, *rope, *relays)  # replaces an earlier attach (e.g. a second trainer on it)

    def detach(self, model: PreTrainedModel) -> None:
        """Undo ``attach``: the model's attention is the inner kernel again, run on the local tokens only."""
        detach_documents(model)
        if attention_shapes(model.config):
            model.set_attn_implementation(_text_only(model, self._inner_key))
            AttentionInterface.register(self.key, _detached)  # the registry no longer holds this attention

    @property
    def _inner_key(self) -> str:
        return "sdpa" if self.kernel == VARLEN_KEY else self.kernel


def _text_only(model: PreTrainedModel, key: str) -> str | dict[str, str]:
    """``set_attn_implementation``'s argument that routes only the text decoder to ``key`` (a VLM's encoders keep
    theirs: a plain string would reach every sub-config)."""
    if not is_multimodal(model):
        return key
    keep = {k: getattr(model.config, k)._attn_implementation for k in encoder_config_keys(model)}
    return {"text_config": key, **keep}


def _detached(module, *args, **kwargs):
    raise RuntimeError(f"{type(module).__name__} called an SP attention that was detached from its model.")


def is_sp_key(key: str | None) -> bool:
    """``key`` (a config's ``_attn_implementation``) routes the attention through SP."""
    return isinstance(key, str) and key.startswith(ULYSSES_KEY)
