"""Shared test harness: tiny models from configs, synthetic data, spawned gloo process groups, and the
reference-vs-SP comparison of per-step loss, grad_norm, eval_loss and final parameters."""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.exactness import EXACT, Verdict, float64_scope, inject_error, judge, widened

VOCAB = 128
FAMILIES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
    "gemma3": "Gemma3TextConfig",
    "phi3": "Phi3Config",
    "gemma4": "Gemma4TextConfig",  # per-layer head sizes (a heterogeneous config), per-layer embeddings, shared kv
    "nemotron": "NemotronConfig",  # its decoder layer calls the attention without **kwargs (SP relays its kwargs)
    "doge": "DogeConfig",  # dynamic-mask attention: each query's top-6 keys by a learned bias, a window of 12
}
MOE_FAMILIES = {  # not dense per-token MLPs (tiled_mlp refuses them)
    "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "gpt_oss": "GptOssConfig",  # attention sinks, alternating sliding window, MoE (eager only)
    "deepseek_v3": "DeepseekV3Config",  # MLA: q/k head dim 24 != v head dim 16; MoE after a dense first layer
    "glm4_moe_lite": "Glm4MoeLiteConfig",  # GLM-4.7-Flash: MLA, MoE after a dense first layer
    "llama4": "Llama4TextConfig",  # chunked attention, NoPE layers with a temperature, MoE
    "deepseek_v32": "DeepseekV32Config",  # MLA + DSA: an indexer's top-k keys per query (attention.dsa)
    "glm_moe_dsa": "GlmMoeDsaConfig",  # GLM-5: DSA with interleaved indexer RoPE, a layer reusing another's top-k
    "minimax_m3": "MiniMaxM3VLTextConfig",  # block-sparse attention: top-2 blocks of 4 keys per KV group
    "deepseek_v4": "DeepseekV4Config",  # window 7 + compressed entries (CSA every 2, top 4; HCA every 8), sinks, mHC
    "hy_v4": "HYV4Config",  # HY-V4: MLA + DSA with learned sinks, hyper-connections, a layer reusing another's top-k
}
# Hybrid models (their linear / SSM / conv layers run exactly under SP through hf_sp_trainer.mixers). transformers'
# own single-process forward leaks their state across position_ids-packed documents, so their references train on
# right-padded rows, one document each: what one device computes for each document alone.
HYBRID_FAMILIES = {
    "qwen3_5": "Qwen3_5TextConfig",  # Gated DeltaNet (conv + delta rule) and gated full attention
    "lfm2": "Lfm2Config",  # gated short convolutions and attention
    "granitemoehybrid": "GraniteMoeHybridConfig",  # Granite-4.0-H: Mamba2 and attention, MoE
    "minimax": "MiniMaxConfig",  # lightning (decayed linear) attention and full attention, MoE
    "mamba2": "Mamba2Config",  # pure Mamba2, no attention (the sequence split only); its CausalLM drops position_ids
    "jamba": "JambaConfig",  # Mamba1 (selective scan, called without **kwargs) and attention, MoE with router loss
    "mamba": "MambaConfig",  # pure Mamba1: its model passes its layers no kwargs at all
    "recurrent_gemma": "RecurrentGemmaConfig",  # RG-LRU (conv + diagonal recurrence) and local attention
    "qwen4_exp": "Qwen4ExpTextConfig",  # Gated DeltaNet + PLE, query-sparse attention (top-2 blocks of 4), MoE
}
PURE_SSM = {"mamba2", "mamba"}  # no attention: eager (no sdpa to set)
# Families whose transformers forward of a position_ids-packed row differs from each document alone (hybrid layers'
# state leaks; Llama-4's NoPE temperature counts the row index): their references train on right-padded rows.
PADDED_REFERENCE = {*HYBRID_FAMILIES, "llama4", "minimax_m3", "deepseek_v4"}  # M3, V4: blocks / windows at row slots
# MoE families with the router's load-balancing loss on (a coefficient large enough to matter in every comparison)
MOE_ROUTER_LOSS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5),
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
    ),
}
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0)
YARN.update(truncate=False, rope_theta=10000.0)
MOE = dict(num_experts_per_tok=2, output_router_logits=False)
MLA = dict(
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32, n_group=1, topk_group=1, **MOE,
)  # fmt: skip
FAMILY_OVERRIDES = {
    "doge": dict(keep_window_size=6, sliding_window=12),  # both under the rows (the top-k and the window act)
    "deepseek_v4": dict(
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"],  # its token-id routed layer, then a learned router
        num_key_value_heads=1,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=7,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
        index_n_heads=16,
        index_head_dim=16,
        index_topk=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),  # fmt: skip
    "qwen4_exp": dict(
        layer_types=["linear_attention", "indexed_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
        indexer_n_heads=16,  # no exact zero-score ties at the k-th block (as for DSA)
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        ple_layer_ids=[1],  # a PLE layer: hashed n-grams of earlier ids and a dilated conv (its released configs)
        ngram_vocab_size_base=64,
    ),  # fmt: skip
    # its window (12) under the rows; its conv across packed documents in transformers' own forward
    "recurrent_gemma": dict(lru_width=64, block_types=["recurrent", "attention"], attention_window_size=12),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=16, expand=2, chunk_size=8),
    "mamba": dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
        mamba_d_state=8,
        mamba_dt_rank=8,
    ),  # fmt: skip
    "gpt_oss": dict(
        num_local_experts=4,
        sliding_window=12,
        layer_types=["sliding_attention", "full_attention"],
        **MOE,
        rope_parameters=dict(YARN, factor=32.0, original_max_position_embeddings=16, rope_theta=150000.0),
    ),  # fmt: skip
    "deepseek_v3": dict(first_k_dense_replace=1, rope_parameters=dict(YARN, mscale_all_dim=1.0), **MLA),  # mscale
    "glm4_moe_lite": dict(mlp_layer_types=["dense", "sparse"], **MLA),
    # top-6 keys per query, under every document (16 indexer heads: no exact score ties at the 6th place)
    "deepseek_v32": dict(first_k_dense_replace=1, index_n_heads=16, index_head_dim=16, index_topk=6, **MLA),
    "glm_moe_dsa": dict(
        mlp_layer_types=["dense", "sparse"],
        indexer_types=["full", "shared"],
        index_n_heads=16,
        index_head_dim=16,
        index_topk=6,
        **MLA,
    ),  # fmt: skip
    "hy_v4": dict(
        mlp_layer_types=["dense", "sparse"],
        layer_types=None,
        indexer_types=["full", "shared"],
        index_n_heads=16,
        index_head_dim=16,
        index_topk=6,
        hc_mult=2,
        **MLA,
    ),  # fmt: skip
    "minimax_m3": dict(
        layer_types=["minimax_m3_sparse", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse"],
        num_local_experts=4,
        num_experts_per_tok=2,
        dense_intermediate_size=128,
        shared_intermediate_size=64,
        rotary_dim=8,
        index_n_heads=2,  # one selection per KV group
        index_head_dim=16,
        index_block_size=4,
        index_topk_blocks=2,
        index_local_blocks=1,
    ),  # fmt: skip
    "llama4": dict(
        num_hidden_layers=4,  # layers 0-2: rope, chunked attention; layer 3: NoPE, full attention, temperature
        moe_layers=[],  # dense: its top-1 router would turn fp32 round-off into other experts over SGD steps
        intermediate_size_mlp=128,
    ),
    "qwen3_5": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    ),  # fmt: skip
    "lfm2": dict(layer_types=["conv", "full_attention"], conv_L_cache=3, block_ff_dim=128),
    "gemma4": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=12,
        global_head_dim=32,  # the full-attention layers' head_dim (per_layer_config)
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2,  # layers 2 and 3 reuse the k/v of layers 0 and 1
        final_logit_softcapping=30.0,
    ),
    "minimax": dict(
        layer_types=["linear_attention", "full_attention"], block_size=8, num_local_experts=4, **MOE
    ),  # blocks of 8: documents span several blocks and shards
    "granitemoehybrid": dict(
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=8,
        mamba_d_conv=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
    ),  # fmt: skip
}


def weak_decay(model: torch.nn.Module, seed: int = 0) -> None:
    """Recurrent layers (GDN, Mamba2: ``A_log``, ``dt_bias``) with weak decay, ``g = -exp(A_log) softplus(dt)`` of
    about -0.01 to -0.06 per token: their state then reaches across documents and ranks, so a dropped or wrong state
    shows (the default init forgets within a few tokens, which also leaves the decay's gradients at fp32 noise)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.1, 0.5, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.full(p.shape, -2.0) + 0.1 * torch.randn(p.shape, generator=gen))


def spread_dynamic_bias(model, seed: int = 0) -> None:
    """Doge's ``A`` (default init 0: its bias ``exp(A softplus(dt_proj(v)))`` is then 1 for every key, and its top-k
    ties everywhere, picking keys by the row's layout) drawn N(0, 0.5^2) and ``dt_proj`` N(0, 0.1^2): biases of
    about 0.1 to 10, far apart against fp32 round-off (the top-k one device picks is the same in any layout and for
    any GEMM shape) and not so large that their logits' round-off dominates (larger ``A`` gives biases of 1e6)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "DogeAttention":
                m.A.copy_(torch.randn(m.A.shape, generator=gen) * 0.5)
                m.dt_proj.weight.copy_(torch.randn(m.dt_proj.weight.shape, generator=gen) * 0.1)


def init_large_sinks(model, seed: int = 0) -> None:
    """Attention sinks (default init 0 or small) drawn large, N(1, 2^2) against row LSEs of ~0-4, so that a sink
    dropped or applied to the wrong heads changes the loss far beyond the tolerance."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):
                m.sinks.copy_(torch.randn(m.sinks.shape, generator=gen) * 2 + 1)


# ----------------------------------------------------------------------------------------------------------------
# process groups
# ----------------------------------------------------------------------------------------------------------------
FP64_EXACT = 1e-12  # the same in float64 (kernel-level checks run in fp64 where they can)
BF16_TOL = 3e-2  # bf16 on both sides: 8 mantissa bits, ~4e-3 per rounding, a few steps of drift


def _free_port() -> int:
    from tests.pool import free_port

    return free_port()


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    from tests.pool import dist_env, error_result

    os.environ.update(dist_env(rank, world_size, port))
    torch.set_num_threads(1)
    try:
        result = ("ok", fn(*args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        result = error_result(exc)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        if result[0] == "ok":
            dist.barrier()  # avoids a sporadic gloo abort at exit
        dist.destroy_process_group()


def _run_fresh(world_size: int, fn: Callable, args: tuple, timeout: float) -> list[tuple[str, Any]]:
    """``fn(*args)`` on ``world_size`` newly spawned processes, which exit afterwards; each rank's (status, value)."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out_dir)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append(("error", f"rank {r} died or hung (exit code {procs[r].exitcode})"))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    return results


def pooled() -> bool:
    """Whether ``run_distributed`` serves cases from the session's persistent worlds (``tests/pool.py``). Not in the
    Triton-interpreter tier (its ranks must import the shims before anything else: it spawns each of its two worlds
    once anyway), nor with ``HF_SP_TEST_FRESH=1`` (every call spawns, as before the pool)."""
    return os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("HF_SP_TEST_FRESH") != "1"


# Every time limit of the spawned worlds (a case's, the family suite's collectives) times this: a suite run at low CPU
# priority beside another (.ci/run's lanes) may wait minutes for a starved peer without anything being wrong.
TIMEOUT_SCALE = float(os.environ.get("HF_SP_TEST_TIMEOUT_SCALE", "1"))
# The cases (parameters with a ``name`` and a ``world_size``) of a narrowed session's selected tests, set by conftest at
# collection: the case harnesses then run only these cases' SP runs and references (a module's world runs every case
# of its lists otherwise). None: every case (a whole-directory session, or one that selected a test of a case module
# not parametrized by a case: it may read any case's run).
SELECTED_CASES: set[str] | None = None


def only_selected(cases) -> list:
    """The ``cases`` the session selected (``SELECTED_CASES``), in order; all of them when it did not narrow."""
    return list(cases) if SELECTED_CASES is None else [c for c in cases if c.name in SELECTED_CASES]


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 1200, fresh: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` CPU processes (gloo); return each rank's result (``timeout`` scaled by
    ``HF_SP_TEST_TIMEOUT_SCALE``).

    The processes are the session's persistent ``world_size`` world (``tests/pool.py``: spawned once, reset after
    every case, respawned after a failure or a timeout); ``fresh=True``: processes spawned for this call alone.
    Either way each rank starts with the distributed environment set and no process group. If any rank raised,
    died or hung, returns the per-rank ``(status, value)`` tuples (``("error", message)``) in place of results.
    """
    timeout *= TIMEOUT_SCALE
    if fresh or not pooled():
        results = _run_fresh(world_size, fn, args, timeout)
    else:
        from tests import pool

        results = pool.run(world_size, fn, args, timeout)
    if any(status == "error" for status, _ in results):
        return results
    return [value for _, value in results]


def _local_share(fn: Callable, items: list) -> list[tuple[str, Any]]:
    """``fn(item)`` for each of ``items`` in turn, each ``("ok", value)`` or ``("error", traceback)``."""
    from tests.pool import error_result

    out = []
    for item in items:
        try:
            out.append(("ok", fn(item)))
        except Exception as exc:  # noqa: BLE001 - reported to the test that needs this item
            out.append(error_result(exc))
    return out


def run_parallel(fn: Callable, items: list, world_size: int = 2, timeout: float = 1200) -> list[Callable[[], Any]]:
    """``fn(item)`` for every item, side by side on the ranks of the session's ``world_size`` world as independent
    single processes (no distributed environment, no process group: what this process is), rank ``r`` taking items
    ``r, r + world_size, ...``; without the pool, serially here. Returns one getter per item, in order: its value, or
    an ``AssertionError`` with the item's traceback (an item that failed fails only the test that asks for it)."""
    if not pooled():
        outcomes = _local_share(fn, items)
    else:
        from tests import pool

        shares = [(fn, items[r::world_size]) for r in range(world_size)]
        results = unwrap_results(pool.run(world_size, _local_share, (), timeout, per_rank=shares, local=True))
        per_rank = [value for _, value in results]
        outcomes = [per_rank[i % world_size][i // world_size] for i in range(len(items))]

    def getter(status: str, value: Any) -> Callable[[], Any]:
        def get() -> Any:
            if status != "ok":
                raise AssertionError(f"the run in a pool rank failed:\n{value}")
            return value

        return get

    return [getter(*o) for o in outcomes]


def unwrap_results(results: list[Any]) -> list[Any]:
    errors = [r[1] for r in results if isinstance(r, tuple) and len(r) == 2 and r[0] == "error"]
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return results


# ----------------------------------------------------------------------------------------------------------------
# models and data
# ----------------------------------------------------------------------------------------------------------------
def tiny_model(family: str, seed: int = 0, attn: str = "sdpa", **overrides):
    import transformers

    config_cls = getattr(transformers, {**FAMILIES, **MOE_FAMILIES, **HYBRID_FAMILIES}[family])
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        use_cache=False,  # sdpa honours packing only without a cache
    )
    if family == "mistral":
        base["sliding_window"] = 12
    if family == "qwen2":
        base.update(use_sliding_window=True, sliding_window=12, max_window_layers=1)
    if family == "gemma3":
        base.update(sliding_window=12, layer_types=["sliding_attention", "full_attention"])
    if family in ("deepseek_v3", "glm4_moe_lite"):
        del base["head_dim"]  # their head_dim is the rotary part of the q/k head dim
    base.update(MOE_ROUTER_LOSS.get(family, {}))
    base.update(FAMILY_OVERRIDES.get(family, {}))
    base.update(overrides)
    config = config_cls(**base)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    init_large_sinks(model, seed)
    weak_decay(model, seed)
    spread_dynamic_bias(model, seed)
    from tests.family_harness import unit_scale_temperature

    unit_scale_temperature(model)  # Gemma4: its q / k norms at the usual 1 / sqrt(head_dim) temperature
    return model.float()


def synthetic_dataset(
    n: int, seed: int = 0, min_len: int = 6, max_len: int = 40, masked_prompt: bool = False, distinct: bool = False
):
    """``n`` random token sequences (ids >= 3); ``masked_prompt`` gives long prompts labelled -100; ``distinct``, no
    token twice in a sequence."""
    rng = random.Random(seed)
    data = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = rng.sample(range(3, VOCAB), length) if distinct else [rng.randrange(3, VOCAB) for _ in range(length)]
        row = {"input_ids": ids}
        if masked_prompt:
            prompt = max(1, int(length * 0.8))
            row["labels"] = [-100] * prompt + ids[prompt:]
        data.append(row)
    return data


# ----------------------------------------------------------------------------------------------------------------
# one training run, reference or SP
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    family: str = "llama"
    attn: str = "sdpa"
    optim: str = "adamw_torch"
    sp_size: int = 2
    world_size: int = 2
    batch_size: int = 3  # per SP group and micro-step
    grad_accum: int = 1
    steps: int = 3
    n_train: int = 0  # 0: exactly enough for `steps` optimizer steps
    n_eval: int = 6
    eval_batch_size: int = 2
    masked_prompt: bool = False
    distinct_tokens: bool = False  # no token twice in a document (Doge: a repeated token ties its first layer's top-k)
    min_len: int = 6
    max_len: int = 40
    model_overrides: dict = field(default_factory=dict)
    train_overrides: dict = field(default_factory=dict)  # extra TrainingArguments for both runs
    backend: str = "ddp"  # ddp | fsdp2 | zero1 | zero2 | zero3, "+offload" for ZeRO CPU offload (SP run only)
    sp_overrides: dict = field(default_factory=dict)  # extra TrainingArguments for the SP run only (e.g. bf16)
    env: dict = field(default_factory=dict)  # environment variables for the SP run (e.g. PARALLELISM_CONFIG_*)
    tol: float = EXACT  # EXACT: judged by tests/exactness.py (float64 past it); another: a plain bar (bf16)
    float64: bool = False  # both runs wholly in float64 (exactness.judge's float64 run)
    inject: tuple[float, bool] | None = None  # a negative control's SP error (exactness.inject_error), SP run only
    hub_kernels: bool = False  # the SP run's model kernelized as from_pretrained does by default from transformers 5.25

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def with_(self, **kw) -> Case:
        return replace(self, **kw)

    def train(self, sp: bool, out_dir: str) -> dict:
        return train_case(self, sp, out_dir)


def backend_args(backend: str) -> dict:
    """TrainingArguments selecting ``backend``: FSDP2 over all ranks, or DeepSpeed ZeRO-n (optionally offloaded)."""
    if backend == "ddp":
        return {}
    if backend == "fsdp2":
        fsdp = {"fsdp_version": 2, "reshard_after_forward": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
        return {"fsdp": True, "fsdp_config": fsdp}
    stage, _, offload = backend.partition("+")
    assert stage in ("zero1", "zero2", "zero3") and offload in ("", "offload"), backend
    zero = {"stage": int(stage[-1])}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero["stage"] == 3:
            zero["offload_param"] = {"device": "cpu"}
    config = {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_force_ds_cpu_optimizer": False,  # the Trainer's torch AdamW, as in the reference, also when offloaded
    }
    return {"deepspeed": config}


def reset_backend_state() -> None:
    """Forget what a previous run in this process left behind (several cases share one spawned process)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a previous ZeRO-3 run would make from_config partition the next model
    leftovers = ("FSDP_", "ACCELERATE_USE_", "PARALLELISM_CONFIG_", "HF_SP_DSA_")
    for key in [k for k in os.environ if k.startswith(leftovers)]:
        del os.environ[key]  # set by a previous run's TrainingArguments (FSDP, DeepSpeed, parallelism config), Case.env


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of the parameters under DDP, FSDP2 (DTensor) or ZeRO-3 (collective on every rank)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {k: _at_least_fp32(v.detach()).clone() for k, v in model.named_parameters()}
    return {
        k: _at_least_fp32((v.full_tensor() if isinstance(v, DTensor) else v).detach()).clone()
        for k, v in model.named_parameters()
    }


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or float64 where it is (a float64 run compares in float64)."""
    return t if t.dtype == torch.float64 else t.float()


def record_inputs(model) -> list[dict[str, torch.Tensor]]:
    """Test instrumentation: every forward of ``model`` appends CPU copies of its token and label tensors."""
    seen: list[dict[str, torch.Tensor]] = []

    def hook(_module, args, kwargs):
        keys = ("input_ids", "labels", "shift_labels", "position_ids")
        seen.append({k: kwargs[k].detach().cpu().clone() for k in keys if kwargs.get(k) is not None})

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def enable_checkpointing(model, **kwargs) -> None:
    """``activation_checkpointing_enable`` (transformers >= 5.24), else its earlier name."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(**kwargs)


# TrainingArguments' activation checkpointing switch: ``activation_checkpointing`` from transformers 5.24
CHECKPOINTING_ARG = (
    "activation_checkpointing"
    if "activation_checkpointing" in __import__("transformers").TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def quiet_args(out_dir: str, steps: int) -> dict:
    """TrainingArguments every comparison run shares: fixed seed, CPU, a log line per step, no saving or reporting."""
    return dict(
        output_dir=out_dir,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_cpu=True,
    )


def build_trainer(case: Case, sp: bool, out_dir: str, ddp: bool = False, **extra_args):
    """The ``case``'s model and trainer: plain ``Trainer`` in one process (``sp=False``), on ``dp`` DDP processes
    (``ddp``: the reference where a loss is not a sum over tokens, e.g. the MoE router loss), or ``SPTrainer``."""
    import transformers
    from transformers import DataCollatorWithFlattening

    from hf_sp_trainer import SPTrainer, TrainingArguments

    reset_backend_state()
    model = tiny_model(case.family, attn=case.attn, **case.model_overrides)
    if sp and case.hub_kernels:
        model.set_use_kernels(True)  # kernelize: what from_pretrained does (use_kernels=None) from transformers 5.25
        assert model.use_kernels
    if case.float64:
        model = widened(model)
    global_batch = case.batch_size * case.dp_size
    n_train = case.n_train or global_batch * case.grad_accum * case.steps
    lengths = dict(min_len=case.min_len, max_len=case.max_len, masked_prompt=case.masked_prompt)
    lengths |= dict(distinct=case.distinct_tokens)
    train = synthetic_dataset(n_train, seed=1, **lengths)
    evals = synthetic_dataset(case.n_eval, seed=2, **lengths)
    common = quiet_args(out_dir, case.steps) | dict(
        num_train_epochs=1,
        gradient_accumulation_steps=case.grad_accum,
        per_device_eval_batch_size=case.eval_batch_size,
        optim=case.optim,
        learning_rate=5e-2 if case.optim == "sgd" else 1e-3,
        weight_decay=0.01,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    common.update(case.train_overrides, **extra_args)
    if sp:
        os.environ.update(case.env)
        common.update(per_device_train_batch_size=case.batch_size, sp_size=case.sp_size, ddp_backend="gloo")
        common.update(backend_args(case.backend), **case.sp_overrides)
        args = TrainingArguments(**common)
        trainer = SPTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals)
        if case.inject is not None:
            inject_error(model, *case.inject)
    else:
        per_device = case.batch_size if ddp else global_batch
        args = transformers.TrainingArguments(
            per_device_train_batch_size=per_device, **common, **(dict(ddp_backend="gloo") if ddp else {})
        )
        padded = case.family in PADDED_REFERENCE
        collator = pad_rows if padded else DataCollatorWithFlattening(return_position_ids=True)
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=train, eval_dataset=evals, data_collator=collator
        )
    return model, trainer, evals


def pad_rows(features: list[dict]) -> dict[str, torch.Tensor]:
    """One right-padded row per example (``attention_mask`` 0 on the padding): each document computed alone."""
    longest = max(len(f["input_ids"]) for f in features)
    ids, labels, mask = [], [], []
    for f in features:
        pad = longest - len(f["input_ids"])
        ids.append(list(f["input_ids"]) + [0] * pad)
        labels.append(list(f.get("labels", f["input_ids"])) + [-100] * pad)
        mask.append([1] * len(f["input_ids"]) + [0] * pad)
    return {k: torch.tensor(v) for k, v in (("input_ids", ids), ("labels", labels), ("attention_mask", mask))}


def packed_predictions(predictions: torch.Tensor, examples: list[dict]) -> torch.Tensor:
    """Right-padded rows' ``[b, s, ...]`` predictions laid end to end, as a packed row ``[1, sum of lengths, ...]``."""
    rows = [predictions[i, : len(e["input_ids"])] for i, e in enumerate(examples)]
    return torch.cat(rows).unsqueeze(0)


def logged_steps(trainer) -> list[tuple[float, float]]:
    """(loss, grad_norm) of every logged optimizer step."""
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]


def _logits(predictions):
    """The logits of ``Trainer.predict``'s predictions (MoE models return ``(logits, aux_loss, ...)``)."""
    if isinstance(predictions, (tuple, list)):
        return next(p for p in predictions if getattr(p, "ndim", 0) == 3)
    return predictions


def train_case(case: Case, sp: bool, out_dir: str, ddp: bool = False) -> dict:
    """Train ``case`` with plain ``Trainer`` (``sp=False``: one process, or ``ddp`` processes) or ``SPTrainer``;
    return what to compare."""
    model, trainer, evals = build_trainer(case, sp, out_dir, ddp=ddp)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    seen = record_inputs(model)
    with float64_scope(model):  # a float64 model's own fp32 islands in float64 too
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
        prediction = trainer.predict(evals[: case.eval_batch_size])  # one batch: logits gathered along the sequence
    empty_shards = sum(int((x["shift_labels"] != -100).sum() == 0) for x in seen if "shift_labels" in x)
    predictions = _at_least_fp32(torch.as_tensor(_logits(prediction.predictions)))
    if not sp and case.family in PADDED_REFERENCE:
        predictions = packed_predictions(predictions, evals[: case.eval_batch_size])
    logs = logged_steps(trainer)
    distributed = sp or ddp
    params = full_parameters(model) if distributed else {k: v.detach().clone() for k, v in model.named_parameters()}
    return {
        "losses": [loss for loss, _ in logs],
        "grad_norms": [norm for _, norm in logs],
        "eval_loss": eval_loss,
        "global_step": trainer.state.global_step,
        "empty_shards": empty_shards,
        "predictions": predictions,
        "test_loss": prediction.metrics["test_loss"],
        "params": params if not distributed or dist.get_rank() == 0 else None,
        "init": init if not distributed or dist.get_rank() == 0 else None,
    }


def run_cases(cases: list, probe: Callable | None = None) -> dict[str, dict]:
    """The one case runner, run in each spawned rank: every case's SP run in turn (``case.train(sp=True, ...)``), with
    its wall time; ``probe(case)``, a context manager yielding a dict, can add counts measured during the run."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            with probe(case) if probe is not None else contextlib.nullcontext({}) as extra:
                start = time.perf_counter()
                result = case.train(sp=True, out_dir=os.path.join(tmp, case.name))
                seconds = time.perf_counter() - start
            out[case.name] = {**result, **extra, "seconds": seconds}
    return out


def sp_runs_by_world(*case_lists: list) -> CaseRuns:
    """Every case's SP run, one spawned group per world size (``run_cases`` on each rank), then every case's
    single-process reference (``reference_runs``)."""
    cases = [c for cases in case_lists for c in cases]
    by_world: dict[int, list] = {}
    for case in cases:
        by_world.setdefault(case.world_size, []).append(case)
    sp = {world: run_distributed(world, run_cases, group) for world, group in by_world.items()}
    return CaseRuns(sp, reference_runs(cases))


@dataclass
class CaseRuns:
    """A module's cases run: ``sp``, per world size, what ``run_cases`` returned on each rank; ``references``, per
    case name, a getter of its single-process run."""

    sp: dict[int, list]
    references: dict[str, Callable[[], dict]]

    def got(self, case) -> dict:
        """``case``'s SP run (rank 0's result)."""
        return unwrap_results(self.sp[case.world_size])[0][case.name]

    def reference(self, case) -> dict:
        """``case``'s single-process run (fails here if that run failed)."""
        return self.references[case.name]()


def single_process_run(case) -> dict:
    """``case.train(sp=False)``, its one-process reference run, in a temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        return case.train(sp=False, out_dir=tmp)


def reference_runs(cases: list) -> dict[str, Callable[[], dict]]:
    """Every case's one-process reference run (``single_process_run``), side by side on the ranks of the 2-rank
    world as independent processes (``run_parallel``: each a process of its own, as this one is); case name -> a
    getter of its result."""
    return dict(zip([c.name for c in cases], run_parallel(single_process_run, cases), strict=True))


def check_sp_case(case, runs: CaseRuns, tol: float) -> dict:
    """``case``'s SP run against its single-process run (both from ``sp_runs_by_world``): the optimizer steps, and
    every reported difference exact (``tol`` ``EXACT``: ``assert_case``) or within ``tol``; the differences."""
    got = runs.got(case)
    ref = runs.reference(case)
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert got["global_step"] == ref["global_step"] == case.steps
    assert_case(case, diffs, ref, tol)
    return diffs


# ----------------------------------------------------------------------------------------------------------------
# comparison
# ----------------------------------------------------------------------------------------------------------------
REPORT_KEYS = ("loss", "grad_norm", "eval_loss", "params", "predict", "test_loss")


def assert_case(case, diffs: dict[str, float], ref32: dict, tol: float = EXACT, float64: bool = True) -> None:
    """A Trainer-level comparison (``compare``'s ``diffs`` against the one-process run ``ref32``) exact by
    ``exactness.judge`` (with its float64 run where ``case`` is a ``Case`` and ``float64``: ``case_verdict``; not
    where the reference is no one-process run, e.g. DDP's), or, for another ``tol`` (bf16), every reported
    difference within it."""
    if tol != EXACT:
        assert_within(case.name, diffs, tol)
        return
    if isinstance(case, Case) and float64:
        verdict = case_verdict(case, diffs, ref32)
    else:
        fp32, key = worst_reported(diffs)
        verdict = judge(case.name, fp32, None, key)
    assert verdict.exact, str(verdict)


def worst_reported(diffs: dict[str, float]) -> tuple[float, str]:
    """The largest of the ``REPORT_KEYS`` differences ``compare`` measured, and its key."""
    return max((diffs[k], k) for k in REPORT_KEYS if k in diffs)


def case_verdict(case, diffs: dict[str, float], ref32: dict, force: bool = False) -> Verdict:
    """A Trainer-level case's fp32 differences judged by ``exactness.judge``: past ``EXACT`` (or ``force``), both runs
    again wholly in float64 (``case.float64``) on the pool, and the one-process fp32 run (``ref32``) against
    float64's."""

    def float64_run() -> tuple[float, float]:
        wide = case.with_(float64=True)
        sp64 = unwrap_results(run_distributed(wide.world_size, run_cases, [wide]))[0][wide.name]
        ref64 = run_parallel(single_process_run, [wide])[0]()
        return worst_reported(compare(ref64, sp64))[0], worst_reported(compare(ref64, ref32))[0]

    fp32, key = worst_reported(diffs)
    return judge(case.name, fp32, float64_run, key, force, control=case.inject is not None)


def assert_within(name: str, diffs: dict[str, float], tol: float) -> None:
    """Every reported difference (those of ``REPORT_KEYS`` that ``compare`` measured) is at most ``tol``."""
    for key in REPORT_KEYS:
        if key in diffs:
            assert diffs[key] <= tol, f"{name}: {key} differs by {diffs[key]:.3e} (relative)"


def logged_throughput_tokens(logs: list[dict]) -> float:
    """The tokens the throughput callback counted over ``logs`` (one optimizer step per entry): tokens/s x step time."""
    return sum(e.get("tokens_per_second_per_rank", 0.0) * e.get("step_time_s", 0.0) for e in logs)


def assert_throughput_counts(counted: float, trained: int, name: str) -> None:
    """The throughput callback counted the tokens of the shards the model trained on (not generation, no-grad
    scoring or the padded batches a PEFT wrapper sees), up to the logged figures' 6 significant digits."""
    assert trained > 0 and abs(counted / trained - 1) < 1e-4, f"{name}: throughput vs trained tokens {counted, trained}"


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def worst_error(ref: tuple[float, dict], got: tuple[float, dict]) -> tuple[float, str]:
    """One forward + backward against its reference, ``(loss, {name: gradient})`` each: the worst relative error and
    where, the loss or a parameter's gradient as ``||d|| / max(||g||, floor)`` with ``floor`` 1e-3 of the typical
    gradient's norm (gradients near zero are compared against the model's scale)."""
    loss_err = abs(got[0] - ref[0]) / max(abs(ref[0]), 1e-12)
    norms = {n: g.norm().item() for n, g in ref[1].items()}
    floor = 1e-3 * (sum(v * v for v in norms.values()) / max(len(norms), 1)) ** 0.5
    worst, where = loss_err, "loss"
    for name, g in ref[1].items():
        err = (got[1][name] - g).norm().item() / max(norms[name], floor, 1e-30)
        if err > worst:
            worst, where = err, name
    return worst, where


def trainer_diffs(got: dict, ref: dict, steps: int) -> dict[str, float]:
    """Per-step ``losses`` and ``grad_norms`` (``steps`` of each on both sides) and the final ``params``: the worst
    relative difference of each."""
    out = {}
    for key in ("losses", "grad_norms"):
        assert len(got[key]) == len(ref[key]) == steps, (key, got[key], ref[key])
        out[key] = max(rel(a, b) for a, b in zip(got[key], ref[key], strict=True))
    return out | {"params": params_rel(got["params"], ref["params"])}


def params_rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """``||got - ref|| / ||ref||`` over every parameter of ``ref`` as one vector."""
    diff = sum(float((got[n].detach() - ref[n]).pow(2).sum()) for n in ref) ** 0.5
    return diff / sum(float(ref[n].pow(2).sum()) for n in ref) ** 0.5


def compare(ref: dict, got: dict) -> dict[str, float]:
    """Relative differences: max over steps of loss and grad_norm, eval_loss, the final parameters as one vector
    (``params``), and, for information, the worst single tensor (``params_tensor``) and the parameter updates
    (``update``; Adam amplifies round-off in gradients that are zero in theory, e.g. key biases)."""
    assert len(ref["losses"]) == len(got["losses"]), (ref["losses"], got["losses"])
    names = list(ref["params"])
    diff_sq = sum(float((got["params"][n] - ref["params"][n]).pow(2).sum()) for n in names)
    norm_sq = sum(float(ref["params"][n].pow(2).sum()) for n in names)
    upd_diff_sq = sum(
        float(((got["params"][n] - got["init"][n]) - (ref["params"][n] - ref["init"][n])).pow(2).sum()) for n in names
    )
    upd_sq = sum(float((ref["params"][n] - ref["init"][n]).pow(2).sum()) for n in names)
    tensor_rel = max(
        float((got["params"][n] - ref["params"][n]).norm() / ref["params"][n].norm().clamp(min=1e-12)) for n in names
    )
    diffs = {}
    if ref.get("predictions") is not None:
        pred_ref, pred_got = ref["predictions"], got["predictions"]
        assert pred_got.shape[1] >= pred_ref.shape[1], (pred_got.shape, pred_ref.shape)  # SP pads to a multiple of sp
        diffs["predict"] = float((pred_got[:, : pred_ref.shape[1]] - pred_ref).norm() / pred_ref.norm())
        diffs["test_loss"] = rel(got["test_loss"], ref["test_loss"])
    if "eval_loss" in ref:
        diffs["eval_loss"] = rel(got["eval_loss"], ref["eval_loss"])
    return diffs | {
        "loss": max(rel(a, b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
        "grad_norm": max(rel(a, b) for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True)),
        "params": (diff_sq / norm_sq) ** 0.5,
        "params_tensor": tensor_rel,
        "update": (upd_diff_sq / max(upd_sq, 1e-30)) ** 0.5,
    }


def row_anchored(bounds: torch.Tensor, rows: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A negative control for ``block_sparse.document_positions``: each position's document, but its position counted
    from the row's first token (transformers' row slots) instead of its document's."""
    from hf_sp_trainer.attention.block_sparse import document_ids

    return document_ids(bounds, rows, seq, device), torch.arange(seq, device=device).expand(rows, -1)
