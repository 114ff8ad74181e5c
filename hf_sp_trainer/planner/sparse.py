"""Routed experts (MoE), multi-head latent attention (MLA) and DeepSeek sparse attention (DSA) for the memory model
(``planner``): their parameters, and what one decoder layer saves per local token under Ulysses SP.

Modeled families (``MODELED``): DeepSeek-V3 (MLA + MoE), DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``: + DSA), Mixtral and
Qwen3-MoE (MoE behind grouped-query attention; Qwen3-MoE's q / k norms, dense layers by ``mlp_only_layers`` /
``decoder_sparse_step``), counted as transformers 5.24 builds them (``tests/test_planner.py`` checks the counts on
real models). Parameters: MLA's
``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj`` without ``q_lora_rank``), ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; a DSA indexer's ``wq_b``, ``wk``, ``k_norm`` (LayerNorm) and
``weights_proj`` (GLM-5's ``"shared"`` layers have none); an MoE MLP's router (``[E, h]``; its score-correction
bias is a buffer), ``E`` experts (``gate_up_proj``, ``down_proj``) and the shared experts (one gated MLP of
``n_shared_experts x moe_intermediate_size``); dense layers (``first_k_dense_replace`` / ``mlp_layer_types``) a
gated MLP of ``intermediate_size``.

Activations (``layer_activations``), per local token, ``b`` bytes per activation, fp32 norms as for dense layers:

* MLA: ``q_a_layernorm`` and ``kv_a_layernorm`` (fp32 input and normalised value, scaled output, the kv input a view
  of ``kv_a``'s whole output in fp32), q and k (``H (nope + rope)`` each) and v (``H v_head_dim``) as the kernel
  keeps them (Ulysses: the all-to-all's outputs; ``H / ulysses`` heads of the whole sequence, per local token the
  same), the kernel's output and ``o_proj``'s input (``H v_head_dim`` each); ``kv_b_proj``'s per-head k/v
  expansion is not kept past the all-to-all (at sp 1 the kernel keeps its v slice, so all of it). DSA with a ring
  keeps the ring group's K/V gathered instead of its own (``ring x`` the k and v per local token; measured on
  ``dsv32-small`` at sp 2 = ring 2: half that extra shows in the peak, so an upper figure).
* MoE (transformers' default ``grouped_mm`` experts, also on CPU): per routed pair (``top_k`` per token) the sorted
  input copy, the ``gate_up`` output (``2 I``), ``act(gate)``, ``act(gate) * up`` and the down projection's output
  (before its routing weight); the router's fp32 scores (``E``), the shared experts as a dense MLP.
* DSA under SP (``attention/dsa.py``): each layer keeps the gathered top-k ``[seq, index_topk]`` int32 (the whole
  sequence's, on every rank: ``sp x index_topk x 4`` bytes per local token) and the documents' ``[seq]`` int64 for
  the backward of its checkpointed query tiles; the kernel's output is not kept (the tiles are recomputed). The
  indexer runs without autograd: its transient scores are at most ``SCORE_BYTES`` per tile (``INDEX_COPIES`` of
  them at once) and come back in the recomputation. At sp 1 transformers' own DSA runs: an ``[s, s]`` additive
  mask kept per layer (the activation dtype), the indexer's ``[s, heads, s]`` fp32 scores transient, and the model's
  ``[s, s]`` bool causal mask (``dsa_fixed``), all O(s^2).

With checkpointing (full) a layer keeps its input; its backward recomputes everything above at once (the indexer's
transient with what precedes it in the layer). Checked against ``scripts/bench_memory.py`` CPU runs (fp32, sp 1 and 2,
plain and checkpointed; ``docs/benchmarks/dsa_memory``). Not validated: bf16 / GPUs (the kernels' temporaries differ),
the tiled MLP (it tiles dense MLPs only, so MoE layers are counted untiled), ``sequence_aware`` and offloading, a
ring beyond 4 (measured: rings of 2 and 4 alone, Ulysses 2 x ring 2). Assumed: a memory-efficient kernel for unequal
q/k and v head sizes (CPU sdpa at sp 1 has none: its math path keeps ``[H, s, s]``; the bench models use equal
sizes). LoRA is refused (``lora_params``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..attention.dsa import SCORE_BYTES

if TYPE_CHECKING:
    from .memory_model import ModelShape, Setting

MODELED = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "mixtral", "qwen3_moe")  # measured: docs/benchmarks/dsa_memory
COUNTED = MODELED  # parameters counted (checked on real models)
EXPERT_SAVED = 4  # per routed pair, x I: gate_up's output (2 I), act(gate), act(gate) * up
INDEX_COPIES = 3  # indexer score tiles alive at once: the product, its scaled copy and that copy's relu
# SP's selected_attention: one query tile's masks and kernel temporaries (its recomputation and backward included),
# 84-103 MiB measured per call on CPU (fp32, 4 heads per rank, 2K-8K tokens, sp_index_topk / selected_attention alone):
# taken as this fraction of SCORE_BYTES
ATTENTION_TILE = 0.375


@dataclass(frozen=True)
class SparseShape:
    """The MoE / MLA / DSA dimensions of a text config (``from_config``: ``None`` for a dense model)."""

    model_type: str
    q_lora: int  # 0: a full-rank q_proj (or not MLA)
    kv_lora: int  # 0: not MLA (Mixtral / Qwen3-MoE: the ModelShape's grouped-query attention)
    qk_nope: int
    qk_rope: int
    v_dim: int
    attention_bias: bool
    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int  # the shared experts' one MLP (0: none)
    moe_layers: int
    indexers: int  # layers running their own DSA indexer
    dsa_layers: int  # layers attending through a DSA selection (their own or a previous layer's)
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    qk_norms: bool = False  # Qwen3-MoE's per-head q / k RMSNorms

    @classmethod
    def from_config(cls, text) -> SparseShape | None:
        kind = getattr(text, "model_type", "")
        if kind not in COUNTED:
            return None
        layers = text.num_hidden_layers
        if kind == "mixtral":
            moe = layers
        elif kind == "qwen3_moe":
            step, dense = text.decoder_sparse_step, set(text.mlp_only_layers or [])
            moe = sum(i not in dense and text.num_experts > 0 and (i + 1) % step == 0 for i in range(layers))
        elif getattr(text, "mlp_layer_types", None):
            moe = list(text.mlp_layer_types).count("sparse")
        else:
            moe = max(0, layers - text.first_k_dense_replace)
        kinds = list(getattr(text, "layer_types", None) or [])
        dsa = kinds.count("indexed_attention")
        indexers = list(getattr(text, "indexer_types", None) or ["full"] * dsa).count("full") if dsa else 0
        experts = getattr(text, "n_routed_experts", None) or getattr(text, "num_local_experts", None)
        mla = bool(getattr(text, "kv_lora_rank", None))
        return cls(
            model_type=kind, q_lora=getattr(text, "q_lora_rank", None) or 0, kv_lora=text.kv_lora_rank if mla else 0,
            qk_nope=getattr(text, "qk_nope_head_dim", 0) if mla else 0, qk_rope=text.qk_rope_head_dim if mla else 0,
            v_dim=text.v_head_dim if mla else 0, attention_bias=bool(getattr(text, "attention_bias", False)),
            experts=experts or text.num_experts, top_k=text.num_experts_per_tok,
            expert_intermediate=getattr(text, "moe_intermediate_size", None) or text.intermediate_size,
            shared_intermediate=(getattr(text, "n_shared_experts", 0) or 0) * (getattr(text, "moe_intermediate_size", 0)
                                                                                or 0),
            moe_layers=moe, indexers=indexers, dsa_layers=dsa, index_heads=getattr(text, "index_n_heads", 0) or 0,
            index_dim=getattr(text, "index_head_dim", 0) or 0, index_topk=getattr(text, "index_topk", 0) or 0,
            qk_norms=kind == "qwen3_moe",
        )  # fmt: skip

    @property
    def qk_dim(self) -> int:
        return self.qk_nope + self.qk_rope

    def describe(self, m: ModelShape) -> str:
        """One line for ``hf-sp-plan``: the MLA, MoE and DSA layers."""
        parts = []
        if self.kv_lora:
            parts.append(f"latent attention (q rank {self.q_lora or 'full'}, kv rank {self.kv_lora}, q/k head "
                         f"{self.qk_nope}+{self.qk_rope}, v head {self.v_dim})")  # fmt: skip
        parts.append(f"{self.moe_layers} MoE layers ({self.experts} experts, top {self.top_k}, expert intermediate "
                     f"{self.expert_intermediate}, shared {self.shared_intermediate}) + "
                     f"{m.layers - self.moe_layers} dense")  # fmt: skip
        if self.dsa_layers:
            parts.append(f"{self.dsa_layers} DSA layers ({self.indexers} indexers of {self.index_heads} x "
                         f"{self.index_dim}, top-{self.index_topk})")  # fmt: skip
        return "; ".join(parts)

    # -- parameters ------------------------------------------------------------------------------------------------
    def attention_params(self, m: ModelShape) -> int:
        """One attention block's (MLA, or ``m``'s grouped-query attention), without a DSA indexer."""
        h, heads, bias = m.hidden, m.heads, self.attention_bias
        if not self.kv_lora:
            q, kv = m.q_dim, m.kv_heads * m.head_dim
            return 2 * h * q + 2 * h * kv + (q + 2 * kv + h) * bias + 2 * m.head_dim * self.qk_norms
        q = h * heads * self.qk_dim
        if self.q_lora:
            q = h * self.q_lora + self.q_lora * bias + self.q_lora + self.q_lora * heads * self.qk_dim
        kv = h * (self.kv_lora + self.qk_rope) + (self.kv_lora + self.qk_rope) * bias + self.kv_lora
        kv += self.kv_lora * heads * (self.qk_nope + self.v_dim)
        return q + kv + heads * self.v_dim * h + h * bias

    def indexer_params(self, m: ModelShape) -> int:
        hi, d = self.index_heads, self.index_dim
        return self.q_lora * hi * d + m.hidden * d + 2 * d + m.hidden * hi

    def mlp_params(self, m: ModelShape, moe: bool) -> int:
        h = m.hidden
        if not moe:
            return 3 * h * m.intermediate
        return self.experts * (3 * h * self.expert_intermediate + h) + 3 * h * self.shared_intermediate

    def layer_params(self, m: ModelShape, moe: bool, indexer: bool) -> int:
        return (self.attention_params(m) + self.indexer_params(m) * indexer + self.mlp_params(m, moe)
                + 2 * m.hidden)  # fmt: skip

    def all_layer_params(self, m: ModelShape) -> int:
        dense = m.layers - self.moe_layers
        return (m.layers * (self.attention_params(m) + 2 * m.hidden) + self.indexers * self.indexer_params(m)
                + dense * self.mlp_params(m, False) + self.moe_layers * self.mlp_params(m, True))  # fmt: skip

    def largest_layer_params(self, m: ModelShape) -> int:
        return self.layer_params(m, self.moe_layers > 0, self.indexers > 0)

    def first_layer_params(self, m: ModelShape) -> int:
        return self.layer_params(m, self.moe_layers == m.layers, self.indexers > 0)

    def largest_tensor(self, m: ModelShape) -> int:
        """The largest parameter tensor's elements (CPU AdamW's per-tensor temporaries)."""
        q = m.heads * self.qk_dim if self.kv_lora else m.q_dim
        experts = self.experts * 2 * self.expert_intermediate * m.hidden * (self.moe_layers > 0)
        return max(m.head_params, m.hidden * max(m.intermediate, q), experts)

    def lora_params(self, m: ModelShape, r: int) -> int:
        """Not counted: PEFT's ``all-linear`` on these models (0.21) wraps the experts' 3D tensors and the router and
        leaves the shared experts' and dense MLPs' linears alone, which is version-dependent; a ``ValueError``."""
        raise ValueError(
            f"{self.model_type}: LoRA on routed-expert models is not modeled (what PEFT's all-linear adapts there, "
            "the experts' tensors and the router included, depends on its version). Measure it with "
            "scripts/bench_memory.py."
        )

    # -- activations -----------------------------------------------------------------------------------------------
    def attention_per_token(self, m: ModelShape, b: int, ulysses: int, sp: int, ring: int = 1) -> float:
        """Bytes one attention block keeps per local token (the module docstring)."""
        heads = m.heads
        if not self.kv_lora:
            kv = math.lcm(m.kv_heads, ulysses) * m.head_dim
            return (3 * m.q_dim + 2 * kv) * b + 2 * heads * m.head_dim * 4 * self.qk_norms
        q_a = self.q_lora * (8 + b) if self.q_lora else 0
        kv_a = (self.kv_lora + self.qk_rope * (b == 4)) * 4 + self.kv_lora * (4 + b)
        v = heads * (self.qk_nope + self.v_dim) if sp == 1 else heads * self.v_dim  # sp 1: kv_b's output via v
        dsa = self.dsa_layers > 0 and sp > 1  # SP's tiles: the kernel's output not kept
        k_v = (heads * self.qk_dim + v) * (ring if dsa else 1)  # a ring: the ring group's K/V, gathered
        return q_a + kv_a + (heads * self.qk_dim + k_v + heads * self.v_dim * (1 if dsa else 2)) * b

    def mlp_per_token(self, m: ModelShape, b: int, moe: bool, tiled: bool) -> float:
        from .memory_model import MLP_SAVED

        if not moe:
            return 0.0 if tiled else MLP_SAVED * m.intermediate * b
        pair = (2 * m.hidden + EXPERT_SAVED * self.expert_intermediate) * b + 24  # + the sort's int64 / fp32 indices
        router = self.experts * 4 + (m.hidden * 4 if b != 4 else 0)  # fp32 scores (and fp32 input copy)
        return self.top_k * pair + router + MLP_SAVED * self.shared_intermediate * b

    def dsa_saved(self, tokens: int, sp: int, b: int) -> float:
        """Bytes one DSA layer keeps beyond its per-token tensors: SP's gathered selection and documents, or (sp 1)
        transformers' ``[s, s]`` additive mask."""
        if sp == 1:
            return b * tokens * tokens
        return sp * tokens * (self.index_topk * 4 + 8)

    def dsa_transient(self, tokens: int, sp: int) -> float:
        """Peak bytes of one DSA layer's indexer and masks, alive for a moment in its forward (and recomputation)."""
        seq = tokens * sp
        if sp == 1:
            return 2 * 4 * seq * seq * self.index_heads  # the scores and their scaled copy (then its relu)
        tile = min(tokens * self.index_heads * seq * 4, SCORE_BYTES)  # one query tile's [tile, heads, seq] fp32
        return INDEX_COPIES * tile + tile / self.index_heads  # + the previous tile's head-weighted sum


def dsa_fixed(sparse: SparseShape, tokens: int, sp: int) -> float:
    """Bytes kept once per forward: at sp 1 transformers' ``[s, s]`` bool causal mask (DSA models build it)."""
    return float(tokens * tokens) if sparse.dsa_layers and sp == 1 else 0.0


def layer_activations(
    m: ModelShape, s: Setting, ulysses: int, tokens: int, moe: bool, ring: int = 1
) -> dict[str, float]:
    """``memory_model._layer_activations`` for an MLA / MoE / DSA decoder layer: what it saves, what a checkpoint
    keeps, and what its backward (with recomputation) needs at once."""
    from .memory_model import MLP_GRAD, MLP_SAVED

    sparse = m.sparse
    assert sparse is not None
    b = 2 if s.dtype == "bf16" else 4
    h = m.hidden
    norms = 2 * h * (8 + b)
    dsa = sparse.dsa_layers > 0
    attn_tokens = sparse.attention_per_token(m, b, ulysses, s.sp, ring) * tokens
    attn = attn_tokens + (sparse.dsa_saved(tokens, s.sp, b) if dsa else 0)
    tiled = s.tiled_mlp and not moe  # the tiled MLP tiles dense MLPs only
    mlp = sparse.mlp_per_token(m, b, moe, tiled) * tokens
    full = norms * tokens + attn + mlp
    checkpoint = h * b * tokens
    saved = full if s.checkpointing == "none" else checkpoint
    recompute = 0.0 if s.checkpointing == "none" else full
    intermediate = (sparse.top_k * sparse.expert_intermediate + sparse.shared_intermediate) if moe else m.intermediate
    if tiled:
        tile = math.ceil(tokens / math.ceil(tokens / max(h, 1024))) if tokens else 0
        mlp_ws = (MLP_SAVED + MLP_GRAD) * m.intermediate * b * tile
    else:
        mlp_ws = MLP_GRAD * intermediate * b * tokens
    mlp_phase = recompute + mlp_ws + h * b * tokens
    attn_phase = (0.0 if s.checkpointing == "none" else norms / 2 * tokens + attn) + attn
    attn_phase += ATTENTION_TILE * SCORE_BYTES if dsa and s.sp > 1 else 0.0
    # the indexer runs after the layer's norm and q / k / v projections (in the forward and the recomputation)
    transient = (norms / 2 * tokens + attn_tokens + sparse.dsa_transient(tokens, s.sp)) if dsa else 0.0
    index_phase = 0.0 if s.checkpointing == "none" else checkpoint + transient
    return {"saved": saved, "checkpoint": checkpoint, "working_set": max(mlp_phase, attn_phase, index_phase),
            "forward": transient}  # fmt: skip


UNMODELED_SETTINGS = "checkpoint_policy='sequence_aware' / 'auto' and checkpoint offloading"


def check_setting(m: ModelShape, s: Setting, auto: bool = False) -> None:
    """A ``ValueError`` for what the memory model does not count with these layers (not measured): what
    ``sequence_aware`` (and ``auto``) keeps of them, and offloading."""
    if m.sparse is not None and (auto or s.checkpointing == "sequence_aware" or s.offload):
        raise ValueError(
            f"{m.name}: the memory model has no count for {UNMODELED_SETTINGS} with routed experts, latent or sparse "
            "attention (not measured): plan with --checkpointing none or full and no offload, or measure with "
            "scripts/bench_memory.py."
        )


def sparse_kinds(m: ModelShape, s: Setting, ulysses: int, ring: int, tokens: int) -> list[tuple[int, dict]]:
    """``(layers, layer_activations)`` of the dense-MLP and the MoE layers of ``m``."""
    sparse = m.sparse
    assert sparse is not None
    check_setting(m, s)
    kinds = [(m.layers - sparse.moe_layers, False), (sparse.moe_layers, True)]
    return [(n, layer_activations(m, s, ulysses, tokens, moe, ring)) for n, moe in kinds if n]
