"""Benchmark: GRPO rollouts with TRL's colocated vLLM engine vs transformers' ``generate``, under SP, on CPU.

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python scripts/bench_vllm_rollouts.py
    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python scripts/bench_vllm_rollouts.py --quick

Every run is ``SPGRPOTrainer`` on the tests' tiny Llama (head_dim 64 for vLLM's CPU attention, fp32, char tokenizer),
``--prompts`` prompts x ``--generations`` completions per step, ``--steps`` optimizer steps, in a fresh process (or
``torchrun`` world) of its own. EOS is suppressed until the completion is ``max_completion_length`` tokens long
(``min_tokens`` for vLLM, ``min_new_tokens`` for ``generate``); the measured mean completion length is reported.

1. Time split of the last step (after a warm-up step; for vLLM it includes the weight sync) at sp 1, per length:
   ``generate_s`` = the trainer's ``_generate_single_turn``, ``score_s`` = its no-grad calls of
   ``_get_per_token_logps_and_entropies`` (TRL scores the completions before the loss only for vLLM's importance
   sampling correction here: beta 0, one iteration), ``step_s`` = ``on_step_begin`` to ``on_step_end`` (a callback),
   ``train_s`` = the rest (rewards, loss forward + backward, optimizer step). The two methods are wrapped on the
   trainer instance, in the worker process only.
2. Peak memory per rank of the vLLM run at ``--mem-length`` (default: the longest length), sp 1 vs sp 2 (two gloo
   ranks, ``sp_generation="replicate"``): VmHWM over ``trainer.train()``, reset after the trainer (and engine) is
   built, glibc told to return freed memory. Every row records its ranks' peaks (``peak_mb_ranks``; ``peak_mb``: the
   largest) and each peak's growth over the resident size at the reset (``step_mb_ranks``: the steps' own memory).

Writes ``results.csv``, ``results.json``, ``results.png`` and the workers' logs (``logs/``) to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from _bench_common import MALLOC_ENV, end_spawned_worker, free_port, peak_mb, pyplot, reset_peak, rss_mb, write_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)
SPLIT = ("generate_s", "score_s", "train_s")


def worker(spec: dict) -> None:
    """One GRPO run (this rank's part of it): writes ``spec["result"]`` + ``.rank<r>.json``."""
    sys.path.insert(0, ROOT)
    import torch
    from transformers import TrainerCallback

    from hf_sp_trainer import GRPOConfig, SPGRPOTrainer
    from hf_sp_trainer.data import build_char_tokenizer
    from tests.grpo_harness import reward_len_and_vowels, rl_dataset, save_policy
    from tests.harness import tiny_model

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    length, vllm = spec["length"], spec["backend"] == "vllm"
    tmp = tempfile.mkdtemp(prefix=f"bench_vllm_rank{rank}_")
    policy = save_policy(tiny_model("llama", head_dim=64, max_position_embeddings=length + 128), f"{tmp}/policy")
    build_char_tokenizer().save_pretrained(policy)  # vLLM loads the model's directory
    rows = spec["prompts"] * spec["generations"]
    kv_bytes = max(64 << 20, 2 * rows * (length + 64) * 2048)  # 2 layers x k, v x 2 kv heads x 64 x fp32 per token
    engine = {"enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": kv_bytes}
    args = GRPOConfig(
        output_dir=tmp, max_steps=spec["steps"], logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, use_cpu=True, learning_rate=1e-3, per_device_train_batch_size=rows,
        num_generations=spec["generations"], max_completion_length=length, bf16=False, beta=0.0,
        shuffle_dataset=False, sp_size=spec["sp"],
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        generation_kwargs={"min_tokens": length} if vllm else {"min_new_tokens": length, "use_cache": True},
        **(dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=length + 64, vllm_engine_kwargs=engine)
           if vllm else {}),
        **(dict(ddp_backend="gloo") if world > 1 else {}),
    )  # fmt: skip
    trainer = SPGRPOTrainer(
        model=policy,
        reward_funcs=reward_len_and_vowels,
        args=args,
        train_dataset=rl_dataset(spec["prompts"] * spec["steps"], seed=31),
        processing_class=build_char_tokenizer(),
    )
    steps: list[dict] = []

    def timed(key: str, fn, no_grad_only: bool = False):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            counted = bool(steps) and not (no_grad_only and torch.is_grad_enabled())
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if counted:
                    steps[-1][key] += time.perf_counter() - start

        return wrapper

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_a, **_k) -> None:
            steps.append({"generate_s": 0.0, "score_s": 0.0, "start": time.perf_counter()})

        def on_step_end(self, *_a, **_k) -> None:
            steps[-1]["step_s"] = time.perf_counter() - steps[-1].pop("start")

    trainer._generate_single_turn = timed("generate_s", trainer._generate_single_turn)
    trainer._get_per_token_logps_and_entropies = timed("score_s", trainer._get_per_token_logps_and_entropies, True)
    trainer.add_callback(StepClock())
    gc.collect()
    reset_peak()
    base = rss_mb()
    trainer.train()
    peak = peak_mb()
    last = steps[-1]
    logs = [e for e in trainer.state.log_history if "completions/mean_length" in e]
    out = {**last, "train_s": last["step_s"] - last["generate_s"] - last["score_s"], "peak_mb": peak, "base_mb": base}
    out["mean_completion_len"] = logs[-1]["completions/mean_length"]
    with open(f"{spec['result']}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    shutil.rmtree(tmp, ignore_errors=True)
    end_spawned_worker()


def launch(spec: dict, out_dir: str, timeout: int) -> dict | None:
    """Run ``spec`` in a fresh process (sp 1) or a ``torchrun`` world of ``sp`` ranks; rank 0's times, every peak."""
    name = f"{spec['backend']}_L{spec['length']}_sp{spec['sp']}"
    spec = {**spec, "result": os.path.join(out_dir, "logs", name)}
    env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, HERE, "--worker", json.dumps(spec)]
    if spec["sp"] > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['sp']}"]
    else:  # the engine starts a world of one: on a free port
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    start = time.perf_counter()
    with open(spec["result"] + ".log", "w") as log:
        try:
            rc = subprocess.run(
                cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    ranks = []
    for r in range(spec["sp"]):
        path = f"{spec['result']}.rank{r}.json"
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    if len(ranks) < spec["sp"]:
        print(f"{name}: failed ({rc}), see {spec['result']}.log")
        return None
    row = {k: spec[k] for k in ("backend", "length", "sp")} | {k: round(ranks[0][k], 3) for k in (*SPLIT, "step_s")}
    row["mean_completion_len"] = round(ranks[0]["mean_completion_len"], 1)
    row["peak_mb"] = round(max(r["peak_mb"] for r in ranks), 1)
    row["peak_mb_ranks"] = " ".join(f"{r['peak_mb']:.1f}" for r in ranks)
    row["step_mb_ranks"] = " ".join(f"{r['peak_mb'] - r['base_mb']:.1f}" for r in ranks)  # over the RSS at the reset
    row["run_s"] = round(time.perf_counter() - start, 1)  # the whole process: imports, engine, steps
    print(f"{name}: step {row['step_s']:.2f} s, peak {row['peak_mb_ranks']} MiB, run {row['run_s']} s", flush=True)
    return row


def print_table(rows: list[dict]) -> None:
    cols = ["backend", "sp", "length", "mean_completion_len", *SPLIT, "step_s", "peak_mb_ranks", "step_mb_ranks"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")


def plot(rows: list[dict], mem_length: int, path: str) -> None:
    """Left: the step's split per length, vLLM vs generate (sp 1). Right: vLLM's peak per rank, sp 1 vs sp 2."""
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    lengths = sorted({r["length"] for r in rows if r["sp"] == 1})
    colors = dict(zip(SPLIT, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for i, backend in enumerate(("vllm", "generate")):
        for j, length in enumerate(lengths):
            row = next((r for r in rows if (r["backend"], r["length"], r["sp"]) == (backend, length, 1)), None)
            bottom = 0.0
            for key in SPLIT if row else ():
                label = key[:-2] if i == j == 0 else None
                hatch = None if backend == "vllm" else "//"
                ax1.bar(j + (i - 0.5) * 0.4, row[key], 0.38, bottom=bottom, color=colors[key], hatch=hatch, label=label)
                bottom += row[key]
            if row:
                ax1.text(j + (i - 0.5) * 0.4, bottom, backend, ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax1.set(
        xlabel="completion length (tokens)", ylabel="seconds (last step)", title="GRPO step, sp 1 (hatched: generate)"
    )
    ax1.legend()
    bars = []  # (label, RSS at the reset, peak)
    for sp in (1, 2):
        row = next((r for r in rows if (r["backend"], r["length"], r["sp"]) == ("vllm", mem_length, sp)), None)
        peaks, steps = (row[k].split() if row else [] for k in ("peak_mb_ranks", "step_mb_ranks"))
        for rank, (peak, step) in enumerate(zip(peaks, steps, strict=True)):
            bars.append((f"sp {sp}\nrank {rank}", float(peak) - float(step), float(peak)))
    labels = [b[0] for b in bars]
    ax2.bar(labels, [b[1] for b in bars], color="tab:gray", label="before train() (model, engine, KV cache)")
    ax2.bar(labels, [b[2] - b[1] for b in bars], bottom=[b[1] for b in bars], color="tab:purple", label="GRPO steps")
    for x, (_, base, peak) in enumerate(bars):
        ax2.text(x, peak, f"{peak:.0f} (+{peak - base:.0f})", ha="center", va="bottom")
    ax2.set(ylabel="peak RSS (MiB)", title=f"vLLM colocate, GRPO steps at {mem_length} tokens: peak per rank")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--mem-length", type=int, default=None, help="the sp 1 vs sp 2 length (default: the longest)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run (the last one is timed)")
    parser.add_argument("--out", default="runs/vllm_rollouts")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="lengths 32 64: a smoke run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        return worker(json.loads(opts.worker))
    lengths = [32, 64] if opts.quick else sorted(opts.lengths)
    mem_length = opts.mem_length or max(lengths)
    os.makedirs(os.path.join(opts.out, "logs"), exist_ok=True)
    common = {"prompts": opts.prompts, "generations": opts.generations, "steps": opts.steps}
    specs = [{"backend": b, "length": n, "sp": 1} for n in lengths for b in ("vllm", "generate")]
    specs += [
        {"backend": "vllm", "length": mem_length, "sp": sp} for sp in (1, 2) if mem_length not in lengths or sp > 1
    ]
    rows = [row for spec in specs if (row := launch(common | spec, opts.out, opts.timeout)) is not None]
    rows.sort(key=lambda r: (r["sp"], r["length"], r["backend"]))
    print_table(rows)
    meta = {"lengths": lengths, "mem_length": mem_length, **common, "timed_step": opts.steps, "model": "tiny llama"}
    write_table(opts.out, "results", rows, meta)
    plot(rows, mem_length, os.path.join(opts.out, "results.png"))


if __name__ == "__main__":
    main()
