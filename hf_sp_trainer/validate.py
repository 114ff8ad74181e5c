"""Whether a model can run sequence parallelism, decided before any collective: the checks every part of SP
(attention, hybrid mixers, VLM parts, position rules, kernels) asks of a model, and the Ulysses x ring split of
``sp_size`` over its heads. A ``ValueError``, the same on every rank, names the values and the fix."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .attention.block_attention import check_kernel
from .attention.position_rules import position_rules
from .attention.ulysses import VARLEN_KEY, is_sp_key
from .mixers.swap import check_cache_arguments
from .model.heads import attention_shapes, head_counts
from .model.mixers import CONTEXT_PARALLEL_ATTENTIONS, check_sequence_mixers, covered_mixers, uses_attention_registry
from .model.vlm import check_multimodal, text_decoder, uses_image_blocks
from .topology import split_sp_size


def validate_model_for_sp(
    model: PreTrainedModel, sp_size: int, ring_size: int | None = None, kernel: str | None = None
) -> tuple[int, int]:
    """Raise a ``ValueError`` (the same on every rank, before any collective) if ``model`` can't run SP; else return
    the ``(ulysses, ring)`` split of ``sp_size`` for its heads."""
    name = type(model).__name__
    if getattr(model.config.get_text_config(), "alibi", False):  # Falcon's: through the prepared mask SP drops
        raise ValueError(
            f"{name} uses ALiBi (config.alibi=True): its position bias reaches attention inside the prepared "
            f"attention mask, which sequence parallelism (sp_size={sp_size}) replaces by the documents' causal "
            "pattern. Use sp_size=1 for this model, or a rotary variant (alibi=False)."
        )
    if not uses_attention_registry(model):
        raise ValueError(
            f"{name} computes attention without the transformers attention registry (AttentionInterface), so "
            f"sequence parallelism (sp_size={sp_size}) can't be plugged in. Use a model whose class sets "
            "`_supports_attention_backend = True` (Llama, Qwen2/3, Mistral, Gemma, Phi3, ...) or sp_size=1."
        )
    check_multimodal(model, sp_size)
    check_sequence_mixers(text_decoder(model), sp_size)  # a VLM's encoders keep their own kernels
    check_cache_arguments(text_decoder(model))  # the swapped modules' cache argument (transformers >= 5.24)
    position_rules(text_decoder(model), model.config.get_text_config())  # Llama-4's chunks and NoPE temperature
    shapes = attention_shapes(model.config)
    if not shapes:  # a pure state-space model (Mamba2ForCausalLM): no heads to split, only the sequence
        if not covered_mixers(text_decoder(model)):
            raise ValueError(
                f"{name} has neither attention heads nor a sequence mixer SP runs exactly (sp_size={sp_size}). Use "
                "sp_size=1 for this model."
            )
        return split_sp_size(sp_size, sp_size, ring_size)  # contiguous shards (zigzag ones with a ring)
    for i, shape in enumerate(shapes):
        if shape.heads % shape.kv_heads:
            raise ValueError(
                f"{name} layer {i} has {shape.heads} query heads, not a multiple of its {shape.kv_heads} kv heads."
            )
    heads, _ = head_counts(model.config)
    check_sinks(model)
    parallel = [type(m).__name__ for m in model.modules() if type(m).__name__ in CONTEXT_PARALLEL_ATTENTIONS]
    if parallel:
        return context_parallel_split(name, parallel, len(shapes), sp_size, ring_size)
    ulysses, ring = split_sp_size(sp_size, heads, ring_size)
    kernel = kernel or model.config._attn_implementation
    if is_sp_key(kernel):
        raise ValueError(f"The inner attention kernel can't be SP's own ({kernel!r}): set sp_attn_implementation.")
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


def context_parallel_split(name: str, parallel: list[str], layers: int, sp_size: int, ring_size: int | None):
    """``(sp_size, 1)`` for a model whose every attention layer splits no heads (``CONTEXT_PARALLEL_ATTENTIONS``:
    contiguous shards, every rank all heads of its own queries), whatever its head count; a ring, or such layers
    beside others, refused."""
    if len(parallel) != layers:
        raise ValueError(
            f"{name} has {len(parallel)} {parallel[0]} layers (every rank keeps all heads of its own queries) among "
            f"{layers} attention layers: SP runs them only in a model of nothing else. Use sp_size=1."
        )
    if ring_size not in (None, 1):
        raise ValueError(
            f"{name}'s {parallel[0]} splits no heads (every rank keeps all heads of its own queries, on contiguous "
            f"shards), so it takes any sp_size and no ring: got sp_ring_size={ring_size}. Set sp_ring_size=1 (or None)."
        )
    return sp_size, 1


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
