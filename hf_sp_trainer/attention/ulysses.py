"""Sequence parallelism as a transformers attention backend: Ulysses, and Ulysses x Ring.

Each rank holds ``s/P`` tokens of every sequence. Before attention an all-to-all over the Ulysses group (``U``
ranks) turns ``[b, h, s/P, d]`` into ``[b, h/U, s/R, d]``: this rank's heads over its ring portion (the whole
sequence when the ring size ``R`` is 1). The inner kernel runs on the whole sequence (``R == 1``), or ring attention
passes K/V blocks around the ring group (``R > 1``); a second all-to-all turns ``[b, s/R, h/U, d]`` back into
``[b, s/P, h, d]``. Document boundaries come from the ``position_ids`` of the whole sequence, gathered once per
forward step by a pre-hook on the decoder.
"""

from __future__ import annotations

import inspect
import math
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from ..layer_configs import attention_shapes, head_counts
from ..mixers.detect import check_sequence_mixers, uses_attention_registry
from ..multimodal.parts import (
    check_multimodal,
    encoder_config_keys,
    image_block_rule,
    is_multimodal,
    text_decoder,
    uses_image_blocks,
)
from ..sharding import SequenceSharding, check_sp_padding
from ..topology import SPTopology, split_sp_size
from .all_to_all import all_gather_along, all_to_all
from .block_attention import check_kernel
from .image_blocks import IMAGE_BLOCKS_KWARG, IMAGE_BLOCKS_MARK, mark_image_block_layers
from .kernels import is_varlen_kernel, resolve_kernel, run_kernel
from .layout import DocumentLayout
from .position_rules import (
    CHUNK_MARK,
    WholeSequenceRope,
    chunk_layout,
    mark_position_rules,
    position_rules,
    retune_temperature,
)
from .ring import autocast_like_sdpa, document_bounds, ring_attention

ULYSSES_KEY = "ulysses_sp"  # must contain neither "flash" nor "sdpa": those trigger special loading paths
VARLEN_KEY = "varlen"  # torch's own varlen flash attention (CUDA): one kernel call per layer for all documents
BOUNDS_KWARG = "sp_document_bounds"  # passed by the decoder pre-hook down to every attention call
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> its gathering pre-hook, rope hooks
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


class _ContiguousOutput:
    """The registered attention: ``UlyssesAttention`` with its output contiguous, as transformers' own kernels return
    it (the inverse all-to-all gives a strided view; JetMoE and AfMoE ``.view`` the output; free for the models that
    reshape it anyway), and the module's own ``sliding_window`` when the model puts it only in the mask SP drops
    (Qwen2-MoE). Every other attribute is the ``UlyssesAttention``'s."""

    def __init__(self, attention: UlyssesAttention):
        self._attention = attention

    def __call__(self, module, *args, **kwargs):
        if "sliding_window" not in kwargs and getattr(module, "sliding_window", None):  # an explicit None stays
            kwargs["sliding_window"] = module.sliding_window
        out, weights = self._attention(module, *args, **kwargs)
        return out.contiguous(), weights

    def __getattr__(self, name):
        return getattr(self._attention, name)


def kv_replication(num_kv_heads: int, sp_size: int) -> int:
    """How often each kv head is repeated so that the kv heads split evenly over ``sp_size`` ranks."""
    return math.lcm(num_kv_heads, sp_size) // num_kv_heads


def validate_model_for_sp(
    model: PreTrainedModel, sp_size: int, ring_size: int | None = None, kernel: str | None = None
) -> tuple[int, int]:
    """Raise a ``ValueError`` (the same on every rank, before any collective) if ``model`` can't run SP; else return
    the ``(ulysses, ring)`` split of ``sp_size`` for its heads."""
    name = type(model).__name__
    if not uses_attention_registry(model):
        raise ValueError(
            f"{name} computes attention without the transformers attention registry (AttentionInterface), so "
            f"sequence parallelism (sp_size={sp_size}) can't be plugged in. Use a model whose class sets "
            "`_supports_attention_backend = True` (Llama, Qwen2/3, Mistral, Gemma, Phi3, ...) or sp_size=1."
        )
    check_multimodal(model, sp_size)
    check_sequence_mixers(text_decoder(model), sp_size)  # a VLM's encoders keep their own kernels
    position_rules(text_decoder(model), model.config.get_text_config())  # Llama-4's chunks and NoPE temperature
    shapes = attention_shapes(model.config)
    if not shapes:  # a pure state-space model (Mamba2ForCausalLM)
        raise ValueError(
            f"{name} has no attention heads: hf_sp_trainer splits sp_size over them (sp_size={sp_size}); SP for models "
            "without attention is not supported yet. Use sp_size=1 for this model."
        )
    for i, shape in enumerate(shapes):
        if shape.heads % shape.kv_heads:
            raise ValueError(
                f"{name} layer {i} has {shape.heads} query heads, not a multiple of its {shape.kv_heads} kv heads."
            )
    heads, _ = head_counts(model.config)
    check_sinks(model)
    ulysses, ring = split_sp_size(sp_size, heads, ring_size)
    kernel = kernel or model.config._attn_implementation
    if kernel == ULYSSES_KEY:
        raise ValueError(f"The inner attention kernel can't be {ULYSSES_KEY!r} itself: set sp_attn_implementation.")
    images = uses_image_blocks(model)  # their extra pairs run on the block kernels, as a ring does
    if ring > 1 or kernel == VARLEN_KEY or images:
        try:
            check_kernel(kernel, model.device, getattr(model.config.get_text_config(), "attn_logit_softcapping", None))
        except ValueError as exc:
            how = f"sp_size={sp_size} runs as ulysses {ulysses} x ring {ring} for {name}'s {heads} query heads"
            if images:
                how = f"{name}'s image tokens see their whole image, which SP computes with its block kernels"
            alt = "" if images else f", or choose an sp_size dividing {heads}"
            raise ValueError(f"{how}: {exc} (sp_attn_implementation){alt}.") from exc
        dropout = getattr(model.config.get_text_config(), "attention_dropout", 0.0)
        if images and dropout:
            raise ValueError(
                f"{name}'s image tokens see their whole image, which SP computes with its block kernels, and those "
                f"have no attention dropout (attention_dropout={dropout}); set it to 0 to train with sp_size={sp_size}."
            )
    return ulysses, ring


def check_sinks(model: torch.nn.Module) -> None:
    """Attention sinks run exactly in their per-head form (a learned logit per query head, ``sinks [heads]``:
    gpt-oss, flint, granite-swa, mimo-v2-flash, ...); refuse the other forms (per-token sinks computed from the
    hidden states, e.g. inkling2's ``sink_proj``) before any collective."""
    name = type(model).__name__
    for path, m in model.named_modules():
        if hasattr(m, "sink_proj"):
            raise ValueError(
                f"{name}.{path} computes per-token attention sinks (sink_proj); SP supports only per-head sink "
                "parameters. Use sp_size=1 for this model."
            )
        sinks = getattr(m, "sinks", None)
        if sinks is not None and len(getattr(sinks, "ds_shape", sinks.shape)) != 1:
            shape = tuple(getattr(sinks, "ds_shape", sinks.shape))
            raise ValueError(
                f"{name}.{path}.sinks has shape {shape}; SP supports one sink logit per query head ([heads])."
            )


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
    """The attention function registered under ``ULYSSES_KEY`` (one per process: the last one attached).

    All-to-all over the Ulysses group, then the inner kernel over the whole sequence (``ring == 1``) or ring attention
    over the ring group for this rank's ring portion, then the inverse all-to-all.
    """

    def __init__(self, topology: SPTopology, sharding: SequenceSharding, kernel: str):
        self.topology, self.sharding, self.kernel = topology, sharding, kernel
        self.layout: DocumentLayout | None = None
        self.positions: torch.Tensor | None = None  # [b, s/P]: each local token's position in its document

    # -- the attention function -------------------------------------------------------------------------------
    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if not getattr(module, DECODER_MARK, False):  # e.g. a VLM's vision tower reached by a shared sub-config key
            raise RuntimeError(
                f"SP attention was called by {type(module).__name__}, which is not part of a text decoder SP was "
                "attached to; encoders must keep their own attention kernel."
            )
        bounds = kwargs.pop(BOUNDS_KWARG, None)  # the whole sequence's documents, from the decoder pre-hook
        if bounds is None or self.layout is None:
            raise RuntimeError("SP attention was called outside a forward of the model it was attached to.")
        blocks = kwargs.pop(IMAGE_BLOCKS_KWARG, None)  # Gemma3's / Gemma4's images, from the media pre-hook
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
        layout = chunk_layout(self.layout, getattr(module, CHUNK_MARK, None))  # Llama-4's chunks: documents here
        if layout is not self.layout:
            bounds = layout.cached("bounds", lambda: document_bounds(layout.segments, layout.position_ids.shape[1]))
        query = retune_temperature(module, query, self.positions)  # Llama-4's NoPE temperature
        sinks = _sinks(module, kwargs, query.shape[1])
        if sinks is not None:  # rank u gets query heads [u * h/U, (u+1) * h/U); slice the materialised parameter
            chunk = query.shape[1] // topo.ulysses_size
            sinks = sinks[topo.ulysses_rank * chunk : (topo.ulysses_rank + 1) * chunk]
            kwargs["s_aux"] = sinks
        rep = kv_replication(key.shape[1], topo.ulysses_size)
        if rep > 1:  # e.g. 2 kv heads on 4 ranks: each rank needs its query heads' kv head
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        query, key, value = autocast_like_sdpa(query, key, value)
        q, k, v = (all_to_all(t, scatter_dim=1, gather_dim=2, group=group) for t in (query, key, value))
        # [b, h/U, s/R, d]: this rank's heads over its ring portion (the whole sequence without a ring)
        if blocks is not None or self._uses_blocks(q, kwargs, sinks is not None):  # one op: all documents, the ring
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
        # transformers validates the inner kernel (installed, GPU, ...); torch's varlen is ours, with sdpa's setup
        model.set_attn_implementation(_text_only(model, self._inner_key))
        AttentionInterface.register(ULYSSES_KEY, _ContiguousOutput(self))
        model.set_attn_implementation(_text_only(model, ULYSSES_KEY))
        decoder = _decoder(model)
        for m in text_decoder(model).modules():
            setattr(m, DECODER_MARK, True)
        mark_image_block_layers(text_decoder(model), image_block_rule(model))
        mark_position_rules(text_decoder(model), model.config.get_text_config())
        for hook in _HOOKS.pop(decoder, []):  # attached before (e.g. a second trainer on the same model): replaced
            hook.remove()
        rope = WholeSequenceRope(self.topology.sp_group).attach(text_decoder(model))  # dynamic NTK, longrope
        _HOOKS[decoder] = [decoder.register_forward_pre_hook(self._before_forward, with_kwargs=True), *rope]

    def detach(self, model: PreTrainedModel) -> None:
        """Undo ``attach``: the model's attention is the inner kernel again, run on the local tokens only."""
        for hook in _HOOKS.pop(_decoder(model), []):
            hook.remove()
        model.set_attn_implementation(_text_only(model, self._inner_key))

    @property
    def _inner_key(self) -> str:
        return "sdpa" if self.kernel == VARLEN_KEY else self.kernel

    def _before_forward(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = input_ids if input_ids is not None else kwargs["inputs_embeds"]
        batch, local_len = tokens.shape[:2]
        group, sp_size = self.topology.sp_group, self.topology.sp_size
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):  # per layer type, as a VLM base hands them on (Gemma3: the media pre-hook's)
            mask = next(iter(mask.values()), None)
        if mask is not None and mask.ndim != 2:
            raise ValueError(
                f"SP got a prepared {mask.ndim}-D attention mask; pass the [batch, seq] padding mask (or none): SP "
                "builds the attention pattern from the documents' positions."
            )
        logits_to_keep = kwargs.get("logits_to_keep")
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:  # Gemma4's decoder would slice its last tokens
            raise ValueError(
                f"SP got logits_to_keep={logits_to_keep}: each rank holds part of the sequence, so its last tokens "
                "are not the sequence's. Call the model without logits_to_keep under sequence parallelism."
            )
        has_padding = mask is not None and not bool(mask.bool().all())
        # One small collective every rank always completes, so a bad input raises everywhere instead of hanging.
        shapes = all_gather_along(
            torch.tensor([[batch, local_len, int(has_padding)]], device=tokens.device), 0, group
        ).tolist()
        if any(row[:2] != shapes[0][:2] for row in shapes):
            raise ValueError(
                "Sequence-parallel ranks received shards of different shapes [batch, local_len]: "
                f"{[row[:2] for row in shapes]}. Every rank of an SP group must get the same batch, split into equal "
                "shards (SPTrainer pads the sequence to a multiple of sp_size)."
            )
        padded = any(row[2] for row in shapes)
        full_len = local_len * sp_size
        if full_len % self.sharding.multiple:
            raise ValueError(
                f"Sequence-parallel shards of {local_len} tokens make a sequence of {full_len}, not a multiple of "
                f"{self.sharding.multiple} (2 x sp_size with a ring); pad the batch with SequenceSharding.shard_batch."
            )
        position_ids = kwargs.get("position_ids")
        rope = None  # multimodal rotary positions [4, b, s/P]: documents come from the text row, the rest passes on
        if position_ids is not None and position_ids.ndim == 3:
            if position_ids.shape[0] != 4:
                raise ValueError(
                    f"SP got position_ids of shape {tuple(position_ids.shape)}: 3-D positions need a text row first "
                    "([4, batch, seq], as hf_sp_trainer.SPMultimodalCollator builds them) to tell documents apart."
                )
            rope, position_ids = position_ids, position_ids[0]
        if position_ids is None:
            position_ids = self.sharding.positions(full_len, self.topology.sp_rank).to(tokens.device).unsqueeze(0)
        position_ids = position_ids.expand(batch, -1)
        self.positions = position_ids
        if padded:  # only the SP padding may be masked (a document of its own at the end): checked on the full rows
            keep = torch.ones_like(position_ids) if mask is None else mask.to(position_ids.dtype).expand(batch, -1)
            full, full_mask = self.sharding.unshard(all_gather_along(torch.stack([position_ids, keep]), 2, group), 2)
            check_sp_padding(full, full_mask, self.sharding.multiple)
        else:
            full = self.sharding.unshard(all_gather_along(position_ids, 1, group))
        self.layout = DocumentLayout.from_position_ids(full)
        bounds = document_bounds(self.layout.segments, full_len)
        kwargs.update(attention_mask=None, use_cache=False, **{BOUNDS_KWARG: bounds})
        kwargs["position_ids"] = position_ids if rope is None else rope
        return args, kwargs


def _text_only(model: PreTrainedModel, key: str) -> str | dict[str, str]:
    """``set_attn_implementation``'s argument that routes only the text decoder to ``key`` (a VLM's encoders keep
    theirs: a plain string would reach every sub-config)."""
    if not is_multimodal(model):
        return key
    keep = {k: getattr(model.config, k)._attn_implementation for k in encoder_config_keys(model)}
    return {"text_config": key, **keep}


def _decoder(model: PreTrainedModel) -> torch.nn.Module:
    """Where the attention kwargs flow: the base model, or the module inside it that holds every decoder layer and
    takes the tokens (OPT's ``model.decoder``, which ``OPTForCausalLM`` calls directly)."""
    module = text_decoder(model) if is_multimodal(model) else getattr(model, model.base_model_prefix, model)
    layers = {id(m) for m in module.modules() if isinstance(m, GradientCheckpointingLayer)}
    while layers:
        inner = [
            child
            for child in module.children()
            if not isinstance(child, torch.nn.ModuleList)
            and layers <= {id(m) for m in child.modules()}
            and {"input_ids", "inputs_embeds"} & set(inspect.signature(child.forward).parameters)
        ]
        if not inner:
            break
        module = inner[0]
    return module
