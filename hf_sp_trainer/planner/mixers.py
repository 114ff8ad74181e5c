"""What the hybrid layers' mixers save per local token and per layer under SP, for the memory model (``planner``):
Gated DeltaNet (Qwen3.5, Qwen3-Next) and LFM2's short conv. Counts follow transformers' torch code paths; other
mixers (Mamba1, Mamba2, lightning, Kimi delta attention, RG-LRU) are refused by name (``check_modeled_layers``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..model.mixers import LAYER_TYPE_FIELDS as MODEL_LAYER_TYPE_FIELDS
from .sparse import MODELED as SPARSE_MODELED

if TYPE_CHECKING:
    from .memory_model import ModelShape

GDN_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule chunk size
# the config fields listing each layer's type, and NemotronH's pattern string (one letter per layer), which the
# planner reads too (the SP checks find NemotronH's mixers from its modules)
LAYER_TYPE_FIELDS = (*MODEL_LAYER_TYPE_FIELDS, "hybrid_override_pattern")
ATTENTION_TYPES = re.compile(r"^(full_attention|sliding_attention|attention|chunked_attention|global|local)$")


def unmodeled_layers(text) -> list[str]:
    """The layer types of a text config the memory model has no count for (Mamba2 and Kimi delta attention, which
    transformers also types ``linear_attention``, lightning attention, MLP-only layers, ...): it models attention,
    Gated DeltaNet (``linear_attention`` with ``linear_num_value_heads``), LFM2's short convs (``conv``) and the DSA
    layers (``indexed_attention``) of ``sparse.MODELED``'s families."""
    field = next((f for f in LAYER_TYPE_FIELDS if getattr(text, f, None)), None)
    kinds = getattr(text, field) if field else []
    gdn = bool(getattr(text, "linear_num_value_heads", 0)) and "kimi" not in getattr(text, "model_type", "")
    dsa = getattr(text, "model_type", "") in SPARSE_MODELED
    modeled = lambda kind: (ATTENTION_TYPES.match(kind) or kind == "conv" or (gdn and kind == "linear_attention")  # noqa: E731
                            or (dsa and kind == "indexed_attention"))  # fmt: skip
    return sorted({str(kind) for kind in kinds if not modeled(str(kind))})


# Config fields of parts the memory model has no count for, whatever the layer types: routed experts (their weights
# and the dispatch's activations are not a dense MLP's) and multi-head latent attention (low-rank q / kv, other head
# sizes for q / k and v)
EXPERT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
LATENT_FIELDS = ("kv_lora_rank",)


def unmodeled_parts(text) -> list[str]:
    """The parts of a text config the memory model would silently count as a dense Llama-style layer: routed
    experts (``EXPERT_FIELDS``) and multi-head latent attention (``LATENT_FIELDS``), but in the families
    ``sparse.MODELED`` models (DeepSeek-V3, DeepSeek-V3.2, GLM-5, Mixtral, Qwen3-MoE)."""
    if getattr(text, "model_type", "") in SPARSE_MODELED:
        return []
    parts = [f"routed experts ({f}={getattr(text, f)})" for f in EXPERT_FIELDS if getattr(text, f, None)][:1]
    parts += [f"multi-head latent attention ({f}={getattr(text, f)})" for f in LATENT_FIELDS if getattr(text, f, None)]
    return parts


def check_modeled_layers(text, name: str) -> None:
    """A ``ValueError`` naming the layer types, else the parts, of ``text`` the memory model has no count for."""
    if unmodeled := unmodeled_layers(text):
        raise ValueError(
            f"{name}: the memory model has no count for its layer types {unmodeled}: it models attention, Gated "
            "DeltaNet (Qwen3.5, Qwen3-Next), short-conv (LFM2) and DeepSeek-V3.2 / GLM-5 sparse attention layers; "
            "Mamba1, Mamba2, Kimi delta, lightning attention and RG-LRU layers (which transformers also types "
            "'linear_attention') and other families' sparse attention are not modeled yet. "
            "Measure such a model with scripts/bench_memory.py."
        )
    if parts := unmodeled_parts(text):
        raise ValueError(
            f"{name}: the memory model has no count for its {' and '.join(parts)}: it models dense Llama-style MLPs "
            "and multi-head / grouped-query attention (and, measured, the experts and latent attention of DeepSeek-V3 "
            "/ V3.2, GLM-5, Mixtral and Qwen3-MoE), and would count these as such (wrong weights, optimizer states and "
            "activations). Measure such a model with scripts/bench_memory.py."
        )


def gdn_core_floats(m: ModelShape, values: int) -> float:
    """fp32 values per token that autograd keeps in transformers' ``torch_chunk_gated_delta_rule`` (the torch path,
    what runs without FLA; FLA's kernel keeps far less), per value head (q and k repeated to the value heads):
    8 ``K``-wide (the fp32 q, k, l2-normed k, scaled q, ``k_beta``, ``k_cumdecay``, decayed q and k), 3
    ``values``-wide (fp32 v, the UT solve's output, each chunk's ``v_new``), 5 chunk-wide (the pairwise decays, the
    two ``k k^T`` / ``q k^T`` products and their decayed results), one ``[K, values]`` state per chunk, ~4 scalars."""
    k, c = m.linear_k_dim, GDN_CHUNK
    return m.linear_v_heads * (8 * k + 3 * values + 5 * c + k * values / c + 4)


def mixer_per_token(m: ModelShape, kind: str, b: int, sp: int) -> float:
    """Bytes a GDN or short-conv mixer saves per local token. GDN: the projections' outputs (qkv, z, b, a; the
    fp32 softplus / decay), the conv's pre-activation and output, the fp32 core (``gdn_core_floats``), the gated
    RMSNorm (fp32 input, normalised value, fp32 gate) and ``out_proj``'s input. Under SP (``sp > 1``) the core runs
    once on values ``[v | 0]`` (``V + K`` wide, for the state summary) and once more for the incoming state's
    correction: the worst case, a document that spans the rank's shard. LFM2's conv: ``B C x``, ``B x``, the conv
    output, ``C y`` (x hidden)."""
    if kind == "conv":
        return 6 * m.hidden * b
    hv, vd, c = m.linear_v_heads, m.linear_v_dim, m.conv_channels
    proj = (2 * c + hv * vd + hv) * b + 3 * hv * 4  # qkv (conv input), conv pre-activation, z, beta; fp32 a, g
    core = gdn_core_floats(m, vd) if sp == 1 else gdn_core_floats(m, vd + m.linear_k_dim) + gdn_core_floats(m, vd)
    return proj + c * b + 4 * core + hv * vd * (3 * 4 + b)  # + the conv output (SiLU), the core, norm + out_proj


def mixer_fixed(m: ModelShape, kind: str, b: int, sp: int, ring: int) -> float:
    """Length-independent bytes of one hybrid mixer under SP (batch 1): the state summaries ``[runs, Hv, K, V + K]``
    (fp32; this rank's and the gathered ``sp`` of them) and the conv halos ``[runs, C, W - 1]`` likewise, ``runs``
    = 2 with a ring (zigzag), else 1."""
    if sp == 1:
        return 0.0
    runs, channels = (2 if ring > 1 else 1), (m.hidden if kind == "conv" else m.conv_channels)
    halo = (sp + 1) * runs * channels * (m.conv_width - 1) * b
    if kind == "conv":
        return halo
    return halo + (sp + 1) * runs * m.linear_v_heads * m.linear_k_dim * (m.linear_v_dim + m.linear_k_dim) * 4
