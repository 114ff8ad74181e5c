"""Benchmark: per-rank peak memory and step time of the memory stack as the sequence length grows.

Each measurement is one real ``SPTrainer`` training step (forward, backward, AdamW step) on ``sp`` spawned processes,
after a short warm-up step that allocates the optimizer state (``ckpt_auto``: and after the steps its policy measures,
full checkpointing at the length): CPU peak = VmHWM of the step (glibc told to return
freed memory), CUDA peak = ``max_memory_allocated``. Feature combinations are ``MemoryArguments`` fields (plus
``gradient_checkpointing``); a combination whose feature is not implemented yet is skipped.

    python scripts/bench_memory.py --model tiny 100m --sp 1 2 4 --lengths tiny:16384 100m:1024 --max-seconds 150
    python scripts/bench_memory.py --model 100m --lengths --search plain@1 everything@1 everything@2 --cap-gib 8
    python scripts/bench_memory.py --device cuda --model llama3-8b --sp 8 --lengths 32768 131072 --attn sdpa
    python scripts/bench_memory.py --model dsv32-small --sp 2 --lengths 2048 8192 --combos plain ckpt_full
    python scripts/bench_memory.py --model dsv32-small --sp 2 --ring 2 --lengths 2048 8192 --combos plain ckpt_full

``--search [MODEL:]COMBO@SP`` finds the longest length under ``--cap-gib`` per process: doubling from
``--search-start``, then ``--bisect`` halvings of the interval. A length whose peak (extrapolated linearly from the
last two measurements) would not fit the machine, or whose step would exceed ``--max-seconds``, is not run: the
result then says it was extrapolated. Writes ``memory.csv``, ``memory.json`` and ``memory.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp
from _bench_common import (
    available_mb,
    end_spawned_worker,
    free_port,
    peak_mb,
    pyplot,
    reset_peak,
    rss_mb,
    set_malloc_env,
    write_table,
)

COMBOS = {
    "plain": {},
    "tiled_mlp": {"tiled_mlp": True},
    "fused_loss": {"fused_loss": True},
    "ckpt_full": {"gradient_checkpointing": True},
    "ckpt_seq_aware": {"gradient_checkpointing": True, "checkpoint_policy": "sequence_aware"},
    "ckpt_auto": {"gradient_checkpointing": True, "checkpoint_policy": "auto"},  # budget: --auto-budget-gib
    "offload": {"gradient_checkpointing": True, "checkpoint_offloading": True},
    # ALST's memory stack (tiled MLP, tiled loss, full checkpointing, checkpoints offloaded), through our features
    "alst_stack": {
        "tiled_mlp": True,
        "fused_loss": True,
        "gradient_checkpointing": True,
        "checkpoint_offloading": True,
    },
    # the same with checkpoint_policy="auto" (budget: --auto-budget-gib, else --cap-gib)
    "auto_stack": {"tiled_mlp": True, "fused_loss": True, "gradient_checkpointing": True, "checkpoint_policy": "auto"},
    "everything": {
        "tiled_mlp": True,
        "fused_loss": True,
        "gradient_checkpointing": True,
        "checkpoint_policy": "sequence_aware",
        "checkpoint_offloading": True,
    },
}
LLAMA_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, vocab_size=32000)  # fmt: skip
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)  # fmt: skip

QWEN35_TINY = dict(  # 3 Gated DeltaNet layers + 1 attention layer, Qwen3.5's layout at a small size
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, layer_types=["linear_attention"] * 3 + ["full_attention"],
)  # fmt: skip
# DeepSeek-V3's layout at a small size: MLA, a dense first layer, then routed + shared experts. v_head_dim = the q/k
# head size: CPU sdpa (sp 1) has a memory-efficient kernel only for equal head sizes (else its O(s^2) math path)
DSV3_SMALL = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48,
    n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=256, n_group=1,
    topk_group=1, first_k_dense_replace=1,
)  # fmt: skip
DSV32_SMALL = dict(DSV3_SMALL, index_n_heads=4, index_head_dim=32, index_topk=256)  # + DeepSeek sparse attention
MIXTRAL_SMALL = dict(  # Mixtral's layout at a small size: grouped-query attention, every MLP 8 routed experts (top 2)
    vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
)  # fmt: skip


QWEN3_MOE_SMALL = dict(  # Qwen3-MoE's layout at a small size: GQA with q / k norms, a dense first layer, then MoE
    vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=8, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[0],
)  # fmt: skip


def model_config(name: str, max_len: int):
    import transformers

    if name == "tiny":  # the main job's model
        path = os.path.join(os.path.dirname(__file__), "..", "hf_sp_trainer", "data", "tiny_llama.json")
        config = transformers.LlamaConfig.from_json_file(path)
    elif name == "qwen35-tiny":  # a hybrid: the planner's Gated DeltaNet layers
        config = transformers.Qwen3_5TextConfig(**QWEN35_TINY)
    elif name == "dsv3-small":  # routed experts and multi-head latent attention
        config = transformers.DeepseekV3Config(**DSV3_SMALL)
    elif name == "dsv32-small":  # the same with DeepSeek sparse attention
        config = transformers.DeepseekV32Config(**DSV32_SMALL)
    elif name == "mixtral-small":  # routed experts behind grouped-query attention
        config = transformers.MixtralConfig(**MIXTRAL_SMALL)
    elif name == "qwen3moe-small":  # routed experts behind grouped-query attention with q / k norms, a dense layer
        config = transformers.Qwen3MoeConfig(**QWEN3_MOE_SMALL)
    else:
        config = transformers.LlamaConfig(**{"100m": LLAMA_100M, "llama3-8b": LLAMA3_8B}[name])
    config.max_position_embeddings = max(max_len, config.max_position_embeddings)
    config.use_cache = False
    return config


def _step_callback(device: str, warmup: int, record: dict):
    from transformers import TrainerCallback

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                _sync(device)
                record["base_mb"] = rss_mb() if device == "cpu" else torch.cuda.memory_allocated() / 2**20
                reset_peak() if device == "cpu" else torch.cuda.reset_peak_memory_stats()
                record["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup + 1:
                _sync(device)
                record["step_s"] = time.perf_counter() - record.pop("start")
                record["peak_mb"] = peak_mb() if device == "cpu" else torch.cuda.max_memory_allocated() / 2**20

    return Measure()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def measure(opts, model_name: str, sp: int, combo: str, length: int, out_dir: str) -> dict:
    """One warm-up step (short row) and one measured step (``length`` tokens) on this rank."""
    import transformers
    from torch.utils.data import SequentialSampler
    from transformers import PrinterCallback

    from hf_sp_trainer import SPDataCollator, SPTrainer, TrainingArguments
    from hf_sp_trainer.memory.checkpointing import KEEP_BUDGET_MARK
    from hf_sp_trainer.memory.keep_budget import KeepBudget

    class Trainer(SPTrainer):
        def _get_train_sampler(self, train_dataset=None):  # the short warm-up row first
            return SequentialSampler(self.train_dataset)

    cuda = opts.device == "cuda"
    torch.manual_seed(0)
    config = model_config(model_name, length)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=opts.attn, dtype=dtype)
    features = dict(COMBOS[combo])
    if features.get("gradient_checkpointing"):
        features["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    auto = features.get("checkpoint_policy") == "auto"
    if auto:  # its first steps run as full checkpointing and measure: the measured step is the one after them
        features["checkpoint_memory_budget"] = (opts.auto_budget_gib or opts.cap_gib) * 2**30
    long_steps = max(opts.long_steps, 1 + (KeepBudget.WARMUP_STEPS if auto else 0))
    ring = getattr(opts, "ring", None) if sp > 1 else None  # callers' options may predate --ring
    args = TrainingArguments(
        output_dir=out_dir, sp_size=sp, sp_ring_size=ring, max_steps=1 + long_steps,
        per_device_train_batch_size=1, optim="adamw_torch",
        learning_rate=1e-5, save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=10,
        use_cpu=not cuda, bf16=cuda, ddp_backend=("nccl" if cuda else "gloo") if sp > 1 else None,
        dataloader_num_workers=0, remove_unused_columns=False, sp_throughput_logging=False, **features,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(length)
    rows = [_row(min(256 * sp, length), opts.doc_len, config.vocab_size, generator)]
    rows += [_row(length, opts.doc_len, config.vocab_size, generator)] * long_steps
    record = {"model": model_name, "sp": sp, "combo": combo, "length": length, "doc_len": opts.doc_len or length}
    if ring:
        record["ring"] = ring
    trainer = Trainer(
        model=model, args=args, train_dataset=rows, data_collator=SPDataCollator(),
        callbacks=[_step_callback(opts.device, len(rows) - 1, record)],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    if auto:
        keep = getattr(model, KEEP_BUDGET_MARK)
        record.update(
            kept_layers=keep.kept_layers[-1], kept_exchanges=keep.kept_exchanges[-1], auto_budget_mb=keep.budget / 2**20
        )
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return record


def _row(length: int, doc_len: int, vocab: int, generator: torch.Generator) -> dict:
    """One packed row of ``length`` tokens: documents of ``doc_len`` tokens (0: one document)."""
    ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
    doc = doc_len or length
    return {"input_ids": ids, "position_ids": [i % doc for i in range(length)]}


def _worker(rank: int, world: int, port: int, opts, jobs: list, out_path: str) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    if opts.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import transformers

    transformers.logging.set_verbosity_error()
    results = [measure(opts, *job, out_dir=os.path.join(os.path.dirname(out_path), "trainer")) for job in jobs]
    if torch.distributed.is_initialized():
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, results)
    else:
        gathered = [results]
    if rank == 0:
        merged = []
        for i, rec in enumerate(results):
            per_rank = [g[i] for g in gathered]
            rec.update(peak_mb=max(r["peak_mb"] for r in per_rank), step_s=max(r["step_s"] for r in per_rank),
                       peak_mb_per_rank=[round(r["peak_mb"], 1) for r in per_rank])  # fmt: skip
            merged.append(rec)
        with open(out_path, "w") as f:
            json.dump(merged, f)
    end_spawned_worker()


def run_jobs(opts, model_name: str, sp: int, jobs: list[tuple[str, int]]) -> list[dict]:
    """Measure ``(combo, length)`` jobs, in order, on ``sp`` fresh processes; one row per job (max over ranks)."""
    out_path = os.path.join(tempfile.gettempdir(), "bench_memory", f"{model_name}_sp{sp}_{time.time_ns()}.json")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    full = [(model_name, sp, combo, length) for combo, length in jobs]
    mp.spawn(_worker, args=(sp, free_port(), opts, full, out_path), nprocs=sp)
    with open(out_path) as f:
        rows = json.load(f)
    for row in rows:
        print(f"{row['model']:>9} sp={row['sp']} {row['combo']:>15} len {row['length']:>7}: "
              f"peak {row['peak_mb']:8.0f} MB/rank  step {row['step_s']:7.2f} s", flush=True)  # fmt: skip
    return rows


def grid(opts) -> list[dict]:
    rows = []
    for model_name in opts.model:
        for sp in opts.sp:
            combos = opts.combos
            lengths = [int(x.split(":")[-1]) for x in opts.lengths if ":" not in x or x.startswith(model_name + ":")]
            last: dict[str, dict] = {}
            for length in lengths:  # one process group per length; a combo predicted too slow is left out
                slow = [
                    c for c in combos if c in last and last[c]["step_s"] * length / last[c]["length"] > opts.max_seconds
                ]
                if slow:
                    print(
                        f"{model_name} sp={sp} len {length}: not run, step predicted over {opts.max_seconds} s: {slow}"
                    )
                jobs = [(c, length) for c in combos if c not in slow]
                got = run_jobs(opts, model_name, sp, jobs) if jobs else []
                rows += got
                if got:  # what was measured so far, in case a later length fails
                    write_table(opts.out, "memory", rows, {"partial": True})
                last.update({r["combo"]: r for r in got})
                combos = [c for c in combos if c not in slow]
    return rows


def search(opts, model_name: str, combo: str, sp: int, known: list[dict]) -> dict:
    """Longest length whose measured per-rank peak is under the cap: doubling, then ``--bisect`` bisections."""
    cap_mb, host_mb = opts.cap_gib * 1024, 0.8 * available_mb()
    measured: list[dict] = []
    result = {"model": model_name, "combo": combo, "sp": sp, "cap_gib": opts.cap_gib, "how": "measured"}

    def extrapolate(length: int, key: str, power: float) -> float | None:
        """Through the two longest measurements, linear in ``length ** power``."""
        if len(measured) < 2:
            return None
        a, b = sorted(measured, key=lambda m: m["length"])[-2:]
        return b[key] + (b[key] - a[key]) * (length**power - b["length"] ** power) / (
            b["length"] ** power - a["length"] ** power
        )

    def fits(length: int) -> bool | None:
        """Measured under (True) or over (False) the cap; None: not run (would not fit the machine, or too slow)."""
        peak, seconds = extrapolate(length, "peak_mb", 1.0), extrapolate(length, "step_s", 2.0)
        if peak is not None and (peak * sp > host_mb or seconds > opts.max_seconds):
            reason = "would not fit this machine" if peak * sp > host_mb else f"step over {opts.max_seconds:.0f} s"
            result["how"] = f"extrapolated linearly from the measured lengths (not run at {length}: {reason})"
            return None
        same = [r for r in known if (r["model"], r["combo"], r["sp"], r["length"]) == (model_name, combo, sp, length)]
        measured.append(same[0] if same else run_jobs(opts, model_name, sp, [(combo, length)])[0])
        return measured[-1]["peak_mb"] <= cap_mb

    fit, over, length = None, None, opts.search_start
    while length <= opts.search_max and (ok := fits(length)):
        fit, length = length, length * 2
    if ok is False:
        over = length
    for _ in range(opts.bisect if fit and over else 0):
        mid = (fit + over) // 2 // (256 * sp) * (256 * sp)
        if mid in (fit, over) or (ok := fits(mid)) is None:
            break
        fit, over = (mid, over) if ok else (fit, mid)
    if result["how"] != "measured" and over is None and len(measured) >= 2:  # where the memory fit crosses the cap
        a, b = sorted(measured, key=lambda m: m["length"])[-2:]
        if b["peak_mb"] < 1.02 * a["peak_mb"]:  # flat: the peak is the weights/optimizer step, not the activations
            result["how"] = f"at least {b['length']} (measured; peak flat, so no extrapolation; longer: too slow)"
            return result | {"max_length": None, "at_least": b["length"], "measured": measured}
        fit = int(b["length"] + (cap_mb - b["peak_mb"]) * (b["length"] - a["length"]) / (b["peak_mb"] - a["peak_mb"]))
        result.update(step_s_estimate=round(extrapolate(fit, "step_s", 2.0), 1))
    best = next((m for m in measured if m["length"] == fit), {})
    return result | {"max_length": fit, "first_over": over, "step_s": best.get("step_s"),
                     "peak_mb": best.get("peak_mb"), "measured": measured}  # fmt: skip


def save_results(opts, rows: list[dict], searches: list[dict]) -> None:
    meta = {"device": opts.device, "attn": opts.attn, "doc_len": opts.doc_len, "cap_gib": opts.cap_gib,
            "date": time.strftime("%Y-%m-%d"), "threads": os.cpu_count()}  # fmt: skip
    write_table(opts.out, "memory", rows, meta | {"searches": searches})
    plt = pyplot()
    if plt is None or not rows:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    sps = sorted({r["sp"] for r in rows})
    fig, axes = plt.subplots(2 * len(models), len(sps), figsize=(4.5 * len(sps), 3.6 * 2 * len(models)), squeeze=False)
    for i, model_name in enumerate(models):
        for j, sp in enumerate(sps):
            for combo in dict.fromkeys(r["combo"] for r in rows):
                pick = [r for r in rows if (r["model"], r["sp"], r["combo"]) == (model_name, sp, combo)]
                lengths = [r["length"] for r in pick]
                for k, key in enumerate(("peak_mb", "step_s")):
                    axes[2 * i + k][j].plot(lengths, [r[key] for r in pick], marker="o", label=combo)
            for k, title in enumerate(("peak MB per rank", "step s")):
                ax = axes[2 * i + k][j]
                ax.set(title=f"{model_name}, sp={sp}: {title}", xlabel="tokens")
                ax.set_xscale("log", base=2)
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(opts.out, "memory.png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = [
        "tiny",
        "100m",
        "llama3-8b",
        "qwen35-tiny",
        "dsv3-small",
        "dsv32-small",
        "mixtral-small",
        "qwen3moe-small",
    ]
    parser.add_argument("--model", nargs="+", default=["tiny", "100m"], choices=models)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ring", type=int, default=None, help="sp_ring_size at sp > 1 (default: from the heads)")
    parser.add_argument("--combos", nargs="+", default=list(COMBOS), choices=list(COMBOS))
    parser.add_argument("--lengths", nargs="*", default=["4096", "8192", "16384"], help="N, or MODEL:N for one model")
    parser.add_argument("--doc-len", type=int, default=0, help="documents per row of this many tokens (0: one)")
    parser.add_argument("--search", nargs="*", default=[], metavar="[MODEL:]COMBO@SP")
    parser.add_argument("--search-start", type=int, default=4096)
    parser.add_argument("--search-max", type=int, default=1 << 20)
    parser.add_argument("--bisect", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=8.0)
    parser.add_argument("--long-steps", type=int, default=1,
                        help="steps at the length, the last one measured (ckpt_auto: at least 3)")  # fmt: skip
    parser.add_argument("--auto-budget-gib", type=float, default=None,
                        help="ckpt_auto's checkpoint_memory_budget per process (default: --cap-gib)")  # fmt: skip
    parser.add_argument("--max-seconds", type=float, default=300.0, help="do not run (longer) steps beyond this")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--out", default="runs/bench_memory")
    opts = parser.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    set_malloc_env()
    rows = grid(opts) if opts.lengths else []
    searches = []
    for spec in opts.search:  # [MODEL:]COMBO@SP
        combo, sp = spec.split(":")[-1].split("@")
        for model_name in [spec.split(":")[0]] if ":" in spec else opts.model:
            searches.append(search(opts, model_name, combo, int(sp), rows))
            print(json.dumps({k: v for k, v in searches[-1].items() if k != "measured"}), flush=True)
    save_results(opts, rows, searches)


if __name__ == "__main__":
    main()
