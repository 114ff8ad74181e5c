"""Analytical per-GPU memory model of one SP training step (``hf-sp-plan``; its searches: ``search``).

Per rank, with ``N`` GPUs, ``sp = ulysses x ring`` ranks per sequence and ``t = ceil(length / sp)`` local tokens:

    peak = runtime + weights + optimizer states + DDP buckets + max(activation phase, gradient phase)
    activation phase = saved activations of all layers + max(loss, LM-head gradient + one layer's working set)
    gradient phase   = max(gradients but the first layer's and the embedding's + one layer's saved + working set,
                           all gradients + optimizer-step temporaries)

The activation phase is the start of backward (every layer's checkpoints, sequence-aware saved tensors or, without
checkpointing, all activations are alive; gradients barely exist), the gradient phase the first layer's backward and
the optimizer step. Weights are in the training dtype (ZeRO-3: sharded over all ``N`` ranks, SP ranks included), so
are gradients (ZeRO-2/3: sharded); AdamW keeps an fp32 master copy and two fp32 moments under bf16 (12 B/param), two
moments under fp32 (8 B/param) (ZeRO-1/2/3: sharded). LoRA (all-linear, ``lora_dropout=0``) trains the adapters only:
the frozen base weights are replicated (ZeRO-3: sharded). Saved per decoder layer and local token: two RMSNorms (fp32
input and normalised value, scaled output), q, k, v, the kernel output and ``o_proj``'s contiguous copy of it, and
``MLP_SAVED`` intermediate-sized tensors (none with the tiled MLP, which keeps its input only). Attention tensors are
per local token whatever the split (Ulysses: ``heads/ulysses`` heads of ``length/ring`` tokens), kv heads replicated
up to ``lcm(kv_heads, ulysses)``; the kernel is memory-efficient (flash / SDPA: no ``s x s`` scores). Memory only:
no step time. Everything else is one of the constants below.

Hybrid models (``config.layer_types``): Gated DeltaNet layers (``linear_attention``: Qwen3.5, Qwen3-Next) and
short conv layers (``conv``: LFM2) save what ``mixers.mixer_per_token`` counts instead of the attention
tensors, plus the length-independent SP summaries of ``mixer_fixed``; their docstrings state what is assumed.

Routed experts, latent and DeepSeek sparse attention (DeepSeek-V3, V3.2, GLM-5, Mixtral): ``sparse``
counts their parameters and what a dense-MLP and an MoE layer save in place of the Llama-style layer's; its docstring
states what is assumed.

GRPO / RLOO (``reference_model``, ``engine_bytes``): the reference model's weights and a colocated vLLM engine's
reservation are added; their scoring forwards need less than the training forward (see ``estimate``).

VLMs (a ``vision_config``): the tower's weights and, per rank, the whole row's pixels and (trained tower) its saved
activations are added (``vision``: SP's whole-media mode encodes every image on every rank).

``device='cpu'`` predicts a ``scripts/bench_memory.py`` CPU run (fp32, process peak RSS), which is how the model is
checked (``tests/test_planner.py``): the runtime is ``CPU_RUNTIME_MIB``, AdamW runs tensor by tensor, and DDP's
buckets count as gradients arrive (DDP rebuilds them at the measured second step; untouched pages are not resident).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..memory.keep_budget import sequence_aware_kept_bytes
from ..topology import split_sp_size
from .mixers import check_modeled_layers, mixer_fixed, mixer_per_token
from .sparse import SparseShape, dsa_fixed, sparse_kinds
from .vision import VisionShape, vision_memory

GIB, MIB = 2**30, 2**20
# -- the model's constants ---------------------------------------------------------------------------------------------
MLP_SAVED = 4  # gated MLP tensors autograd keeps: gate, up, act(gate), act(gate)*up (x intermediate)
MLP_GRAD = 2  # MLP backward temporaries alive at once with them (x intermediate)
LOGITS_COPIES = 3  # fp32 [tokens, vocab] at the cross-entropy backward: log-softmax output, its grad, the logits' grad
A2A_COPIES = 2  # an all-to-all's stacked send buffer and its receive buffer (x the tensor sent)
OFFLOAD_IN_FLIGHT = 2  # layers whose checkpoints are on the GPU with activation offloading (being copied either way)
ZERO3_LIVE_LAYERS = 2  # ZeRO-3: gathered layers at a time (the current one and the prefetched one)
CPU_RUNTIME_MIB = 485.0  # RSS of a bench_memory CPU worker before its measured step, less its model's weights and
# AdamW states (Python, torch, transformers, the Trainer, gloo): 477-491 MiB in docs/benchmarks/*/memory.json base_mb
CUDA_OVERHEAD_GIB = 3.0  # CUDA context, NCCL buffers, allocator fragmentation: an assumption, not measured here
MAX_LENGTH = 1 << 26  # the length search stops here
MIXER_GRAD = 1  # a hybrid mixer's backward temporaries alive at once with its saved tensors (x its saved set)
MIXER_TRANSIENT = 0.15  # checkpointed: the recomputation's temporaries (x its saved set), alive with all it recomputed


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of a decoder-only transformer config (Llama-style gated MLP)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    gdn_layers: int = 0  # Gated DeltaNet layers (layer_types "linear_attention")
    conv_layers: int = 0  # short conv layers (LFM2's "conv")
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_width: int = 4  # GDN's linear_conv_kernel_dim, LFM2's conv_L_cache
    gated_attention: bool = False  # Qwen3.5 / Qwen3-Next attention: q_proj also yields an output gate; q/k norms
    vision: VisionShape | None = None  # a VLM's tower (planner.vision); the fields above are its text decoder's
    sparse: SparseShape | None = None  # routed experts / MLA / DSA (planner.sparse)

    @classmethod
    def from_config(cls, config, name: str = "") -> ModelShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "is_heterogeneous", False):
            raise ValueError(
                f"{name or type(text).__name__} sets {sorted(text.per_layer_attributes)} per layer (per_layer_config); "
                "the memory model takes one shape for every layer. Measure such a model with scripts/bench_memory.py."
            )
        heads = getattr(text, "num_attention_heads", None)
        if not heads:
            raise ValueError(
                f"{name or type(text).__name__} has no attention heads (a pure state-space model): the memory model "
                "has no count for it. Measure such a model with scripts/bench_memory.py."
            )
        kinds = list(getattr(text, "layer_types", None) or [])
        if not getattr(text, "intermediate_size", None):
            raise ValueError(f"{name or type(text).__name__}: no intermediate_size (only dense decoder-only models).")
        check_modeled_layers(text, name or type(text).__name__)
        return cls(
            name=name or getattr(text, "_name_or_path", "") or text.model_type, hidden=text.hidden_size,
            intermediate=text.intermediate_size, layers=text.num_hidden_layers, heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab=text.vocab_size,
            tied=bool(getattr(text, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(text, "attention_bias", text.model_type == "qwen2")),
            gdn_layers=kinds.count("linear_attention"), conv_layers=kinds.count("conv"),
            linear_k_heads=getattr(text, "linear_num_key_heads", 0) or 0,
            linear_v_heads=getattr(text, "linear_num_value_heads", 0) or 0,
            linear_k_dim=getattr(text, "linear_key_head_dim", 0) or 0,
            linear_v_dim=getattr(text, "linear_value_head_dim", 0) or 0,
            conv_width=getattr(text, "linear_conv_kernel_dim", None) or getattr(text, "conv_L_cache", None) or 4,
            gated_attention=text.model_type.startswith(("qwen3_5", "qwen3_next")), sparse=SparseShape.from_config(text),
        )  # fmt: skip

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def attention_layers(self) -> int:
        return self.layers - self.gdn_layers - self.conv_layers

    @property
    def conv_channels(self) -> int:
        """GDN's conv channels ``2 Hk K + Hv V`` (q, k, v)."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    def _kind_params(self, kind: str) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_heads * self.head_dim
        common = 3 * h * self.intermediate + 2 * h
        if kind == "gdn":  # in_proj_qkv, z, b, a, out_proj, conv, dt_bias, A_log, the gated norm
            hv, vd = self.linear_v_heads, self.linear_v_dim
            c = self.conv_channels
            return common + h * (c + 2 * hv * vd + 2 * hv) + c * self.conv_width + 2 * hv + vd
        if kind == "conv":  # in_proj (B, C, x), out_proj, the depthwise conv (no bias)
            return common + 4 * h * h + h * self.conv_width
        gate = (h * q + 2 * self.head_dim) * self.gated_attention
        return common + 2 * h * q + 2 * h * kv + (q + 2 * kv) * self.qkv_bias + gate

    @property
    def layer_params(self) -> int:
        """The largest layer's parameters (every layer's for a dense model)."""
        if self.sparse is not None:
            return self.sparse.largest_layer_params(self)
        kinds = ["attention"] * (self.attention_layers > 0) + ["gdn"] * (self.gdn_layers > 0)
        return max(self._kind_params(k) for k in kinds + ["conv"] * (self.conv_layers > 0))

    @property
    def all_layer_params(self) -> int:
        if self.sparse is not None:
            return self.sparse.all_layer_params(self)
        return (self.attention_layers * self._kind_params("attention") + self.gdn_layers * self._kind_params("gdn")
                + self.conv_layers * self._kind_params("conv"))  # fmt: skip

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.all_layer_params + self.head_params * (1 if self.tied else 2) + self.hidden

    def lora_params(self, r: int) -> int:
        """Adapters on every linear layer of every decoder layer (PEFT ``all-linear``: not the LM head)."""
        if self.sparse is not None:
            return self.sparse.lora_params(self, r)
        h, q, kv, i = self.hidden, self.q_dim, self.kv_heads * self.head_dim, self.intermediate
        hv, vd = self.linear_v_heads, self.linear_v_dim
        gdn = (h + self.conv_channels) + 2 * (h + hv * vd) + 2 * (h + hv)
        attention = 2 * (h + q) + 2 * (h + kv) + q * self.gated_attention
        mixers = self.attention_layers * attention + self.gdn_layers * gdn
        return r * (mixers + self.conv_layers * ((h + 3 * h) + 2 * h) + self.layers * 3 * (h + i))


@dataclass(frozen=True)
class Setting:
    """One training configuration on ``gpus`` ranks. ``device='cpu'`` predicts a ``bench_memory.py`` CPU run."""

    gpus: int
    sp: int
    ring: int | None = None
    zero: int = 0
    lora: bool = False
    lora_r: int = 16
    tiled_mlp: bool = False
    fused_loss: bool = False
    checkpointing: str = "full"  # none | full | sequence_aware
    offload: bool = False
    dtype: str = "bf16"
    device: str = "cuda"
    image_share: float = 0.0  # VLMs: the fraction of the row's tokens that are image placeholders
    vision_trained: bool | None = None  # VLMs: the tower trains (default: unless LoRA, which freezes it)
    split_media: bool = False  # VLMs: sp_split_media (each rank encodes 1/sp of the images)
    reference_model: bool = False  # GRPO / RLOO with beta > 0 (not LoRA): TRL's frozen reference copy of the weights
    engine_bytes: float = 0.0  # GRPO / RLOO: a colocated vLLM engine's reservation (gpu_memory_utilization x memory)
    engine_sleeps: bool = False  # vllm_enable_sleep_mode: the engine's memory is released while the trainer steps

    def validate(self) -> None:
        if self.gpus < 1 or self.sp < 1 or self.gpus % self.sp:
            raise ValueError(f"sp={self.sp} must divide the number of GPUs {self.gpus}.")
        if self.zero not in (0, 1, 2, 3) or self.dtype not in ("bf16", "fp32") or self.device not in ("cuda", "cpu"):
            raise ValueError(f"bad zero/dtype/device: {self.zero}, {self.dtype}, {self.device}")
        if self.checkpointing not in ("none", "full", "sequence_aware"):
            raise ValueError(f"checkpointing must be none, full or sequence_aware, not {self.checkpointing!r}")
        if self.offload and self.checkpointing == "none":
            raise ValueError("activation offloading moves the checkpoints: it needs checkpointing.")
        if self.engine_bytes < 0 or (self.engine_bytes and self.device == "cpu"):
            raise ValueError("engine_bytes: a colocated vLLM engine's GPU reservation (>= 0; none on device='cpu').")
        if not 0.0 <= self.image_share < 1.0:
            raise ValueError(f"image_share is a fraction of the row's tokens in [0, 1), not {self.image_share}.")


@dataclass
class Breakdown:
    """Per-rank bytes of each part of the model, the two phases and the peak (all in bytes)."""

    length: int
    local_tokens: int
    ulysses: int
    ring: int
    runtime: float
    weights: float
    gradients: float
    optimizer_states: float
    comm_buffers: float
    saved_activations: float
    layer_working_set: float
    loss: float
    optimizer_step: float
    activation_phase: float
    gradient_phase: float
    peak: float
    reference_weights: float = 0.0  # GRPO / RLOO: the reference model's weights (in the peak)
    engine: float = 0.0  # GRPO / RLOO: a colocated vLLM engine's reservation (in the peak, unless it sleeps)
    host_offload: float = 0.0  # host memory of the offloaded checkpoints, per rank
    vision_activations: float = 0.0  # a VLM tower's saved tensors and the row's pixels (in saved_activations)

    @property
    def peak_phase(self) -> str:
        return "activations" if self.activation_phase >= self.gradient_phase else "gradients"

    def as_dict(self) -> dict:
        return asdict(self) | {"peak_phase": self.peak_phase}


def _hybrid_activations(m: ModelShape, s: Setting, ring: int, tokens: int, kind: str) -> dict[str, float]:
    """``_layer_activations`` for a GDN or conv layer: the mixer in place of the attention tensors. Checkpointing
    (full or sequence_aware: nothing of a mixer is kept, ``recompute_region``) recomputes the whole layer when its
    backward starts (plus ``MIXER_TRANSIENT`` of the mixer's saved set in temporaries); the mixer's own backward then
    frees its recomputed tensors about as fast as its ``MIXER_GRAD`` x gradients grow. Fitted to
    ``docs/benchmarks/hybrid/memory.json`` (``tests/test_planner.py``)."""
    b = 2 if s.dtype == "bf16" else 4
    h, i = m.hidden, m.intermediate
    norms = 2 * h * (8 + b)
    mixer = mixer_per_token(m, kind, b, s.sp) * tokens + mixer_fixed(m, kind, b, s.sp, ring)
    mlp = 0 if s.tiled_mlp else MLP_SAVED * i * b
    full = (norms + mlp) * tokens + mixer
    checkpoint = h * b * tokens
    saved = full if s.checkpointing == "none" else checkpoint
    recompute = 0.0 if s.checkpointing == "none" else full
    if s.tiled_mlp:
        tile = math.ceil(tokens / math.ceil(tokens / max(h, 1024))) if tokens else 0
        mlp_ws = (MLP_SAVED + MLP_GRAD) * i * b * tile
    else:
        mlp_ws = MLP_GRAD * i * b * tokens
    mlp_phase = recompute + mlp_ws + h * b * tokens + (0.0 if s.checkpointing == "none" else MIXER_TRANSIENT * mixer)
    mixer_phase = (0.0 if s.checkpointing == "none" else norms / 2 * tokens) + MIXER_GRAD * mixer
    return {"saved": saved, "checkpoint": checkpoint, "working_set": max(mlp_phase, mixer_phase)}


def _layer_activations(m: ModelShape, s: Setting, ulysses: int, ring: int, tokens: int) -> dict[str, float]:
    """Bytes of one attention decoder layer for ``tokens`` local tokens: what it saves, what a checkpoint keeps, and
    what its backward (with recomputation) needs at once."""
    b = 2 if s.dtype == "bf16" else 4
    h, q, i = m.hidden, m.q_dim, m.intermediate
    kv = math.lcm(m.kv_heads, ulysses) * m.head_dim  # per local token, after replication for the all-to-all
    norms = 2 * h * (8 + b)  # two RMSNorms: fp32 input and normalised value, scaled output
    attn = (3 * q + 2 * kv) * b  # q, k, v, kernel output, o_proj's input
    mlp = 0 if s.tiled_mlp else MLP_SAVED * i * b
    full = (norms + attn + mlp) * tokens
    stored = 0.0  # sequence_aware: kept from the forward instead of recomputed
    if s.checkpointing == "sequence_aware":
        stored = sequence_aware_kept_bytes(tokens, q, b, ring)  # the kernel's output (each ring block's)
    checkpoint = h * b * tokens
    saved = {"none": full, "full": checkpoint, "sequence_aware": checkpoint + stored}[s.checkpointing]
    recompute = 0.0 if s.checkpointing == "none" else full - stored
    if s.tiled_mlp:  # one tile's MLP, recomputed in backward (tiled_mlp.py's default tiles)
        tile = math.ceil(tokens / math.ceil(tokens / max(h, 1024))) if tokens else 0
        mlp_ws = (MLP_SAVED + MLP_GRAD) * i * b * tile
    else:
        mlp_ws = MLP_GRAD * i * b * tokens
    mlp_phase = recompute + mlp_ws + h * b * tokens  # + the incoming gradient
    attn_recompute = 0.0 if s.checkpointing == "none" else (norms / 2 + attn) * tokens - stored
    attn_grads = (2 * q + 2 * kv) * b * tokens  # dq, dk, dv and the output's gradient
    comm = A2A_COPIES * q * b * tokens if ulysses > 1 else 0.0
    if ring > 1:  # fp32 output/dq accumulator; K/V held, in flight, dK/dV accumulator (fp32) and its shift (fp32)
        comm += (4 * q + 2 * kv * (2 * b + 2 * 4)) * tokens
    attn_phase = attn_recompute + attn_grads + comm
    return {"saved": saved, "checkpoint": checkpoint, "working_set": max(mlp_phase, attn_phase)}


def estimate(m: ModelShape, s: Setting, length: int) -> Breakdown:
    """Predicted per-rank memory of one training step on ``length``-token sequences (batch 1)."""
    s.validate()
    ulysses, ring = split_sp_size(s.sp, m.heads, s.ring)
    tokens = math.ceil(length / s.sp)
    cpu, b = s.device == "cpu", (2 if s.dtype == "bf16" else 4)
    n = s.gpus
    trainable = m.lora_params(s.lora_r) if s.lora else m.params
    grad_shards, opt_shards = (n if s.zero >= 2 else 1), (n if s.zero >= 1 else 1)
    weights = (m.params + (trainable if s.lora else 0)) * b / (n if s.zero == 3 else 1)
    gradients = trainable * b / grad_shards
    optimizer_states = trainable * (12 if b == 2 else 8) / opt_shards
    buckets = trainable * b if (s.zero == 0 and n > 1) else 0.0  # DDP's flat gradient buckets
    if cpu:  # single-tensor AdamW: sqrt and division temporaries of the largest tensor
        largest = max(m.head_params, m.hidden * max(m.intermediate, m.q_dim))
        largest = 0 if s.lora else (m.sparse.largest_tensor(m) if m.sparse else largest)
        optimizer_step = 2 * 4 * largest
    else:  # multi-tensor AdamW / ZeRO: one fp32 copy of the local optimizer shard (upcast grads or sqrt(v))
        optimizer_step = 4 * trainable / opt_shards

    vision = {"saved": 0.0}
    if m.vision is not None:  # every rank encodes the whole row's images (whole media), or 1/sp of them (split media)
        trained = (not s.lora) if s.vision_trained is None else s.vision_trained
        ckpt, split = s.checkpointing != "none", s.sp if s.split_media else 1
        vision = vision_memory(m.vision, length, s.image_share, trained, ckpt, b, n, s.zero, split)
        weights += vision["weights"]
        gradients += vision["gradients"]
        optimizer_states += vision["optimizer_states"]
        buckets += vision["buckets"]

    if m.sparse is not None:  # routed experts / MLA / DSA: a dense-MLP and an MoE kind
        kinds = sparse_kinds(m, s, ulysses, ring, tokens)
    else:
        kinds = [(m.attention_layers, _layer_activations(m, s, ulysses, ring, tokens))]
    kinds += [(n, _hybrid_activations(m, s, ring, tokens, kind)) for n, kind in
              ((m.gdn_layers, "gdn"), (m.conv_layers, "conv")) if n]  # fmt: skip
    kinds = [(n, layer) for n, layer in kinds if n]
    per_layer_saved = max(layer["saved"] for _, layer in kinds)
    saved = sum(n * layer["saved"] for n, layer in kinds) + vision["saved"]
    saved += dsa_fixed(m.sparse, tokens, s.sp) if m.sparse else 0.0
    host = 0.0
    if s.offload and not cpu:  # checkpoints live on the host but for the layers being copied
        host = max(0, m.layers - OFFLOAD_IN_FLIGHT) * kinds[0][1]["checkpoint"]  # the same for every kind
        saved -= host
    head_grad_full = 0.0 if s.lora else m.head_params * b  # made whole, then (ZeRO-2/3) reduce-scattered
    head_grad = head_grad_full / grad_shards
    if s.fused_loss:  # one chunk's logits (losses/fused.py's default chunks); the head's gradient is accumulated
        chunk = math.ceil(tokens / math.ceil(m.vocab / m.hidden)) if tokens else 0
        loss = chunk * m.vocab * 4 * LOGITS_COPIES + head_grad + head_grad_full
    else:
        logits = tokens * m.vocab * 4
        loss = max(LOGITS_COPIES * logits, logits + head_grad_full) + (tokens * m.vocab * b if b != 4 else 0)
    loss += m.hidden * (8 + b) * tokens  # the final norm's saved tensors, freed before the last layer's backward
    working_set = max(layer["working_set"] for _, layer in kinds)
    if s.zero == 3:  # gathered full weights: a layer and its prefetched successor, or the LM head
        working_set += ZERO3_LIVE_LAYERS * m.layer_params * b
        loss += m.head_params * b
    # gradients present while the first layer runs backward: all but its own and the embedding's
    first = m.sparse.first_layer_params(m) if m.sparse else m.layer_params
    early = 1 - (1 / m.layers if s.lora else (first + (0 if m.tied else m.head_params)) / m.params)
    lazy = buckets if cpu else 0.0  # on CPU the rebuilt buckets are touched (resident) as gradients arrive
    activation_phase = saved + max(loss, head_grad + working_set) + (head_grad if lazy else 0.0)
    forward = max(layer.get("forward", 0.0) for _, layer in kinds)  # a DSA indexer's scores, in the last layer's
    activation_phase = max(activation_phase, saved - per_layer_saved + forward)  # forward (before its saved tensors)
    gradient_phase = max((gradients + lazy) * early + per_layer_saved + working_set,
                         gradients + lazy + optimizer_step)  # fmt: skip
    runtime = CPU_RUNTIME_MIB * MIB if cpu else CUDA_OVERHEAD_GIB * GIB
    reference = m.params * b / (n if s.zero == 3 else 1) if s.reference_model and not s.lora else 0.0
    static = runtime + weights + optimizer_states + reference
    peak = static + (0.0 if cpu else buckets) + max(activation_phase, gradient_phase)
    # GRPO / RLOO: the scoring forwards (old policy, reference) run without gradients, keep no activations and make
    # fewer logits copies than the loss: never above the activation phase. A colocated engine holds its reservation
    # throughout, or (sleep mode) only while it generates, when the trainer holds its weights and optimizer states.
    peak = max(peak, static + s.engine_bytes) if s.engine_sleeps else peak + s.engine_bytes
    if cpu:  # VmHWM is reset at the measured step's start, when the previous step's buckets are still resident
        peak = max(peak, static + buckets)
    return Breakdown(
        length=length, local_tokens=tokens, ulysses=ulysses, ring=ring, runtime=runtime, weights=weights,
        gradients=gradients, optimizer_states=optimizer_states, comm_buffers=buckets, saved_activations=saved,
        layer_working_set=working_set, loss=loss, optimizer_step=optimizer_step, activation_phase=activation_phase,
        gradient_phase=gradient_phase, peak=peak, reference_weights=reference, engine=s.engine_bytes,
        host_offload=host, vision_activations=vision["saved"],
    )  # fmt: skip
