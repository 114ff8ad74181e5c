"""Benchmark: balanced vs plain data parallelism on long-tail document lengths (issue 34, measurement e).

``SPTrainer`` with ``train_sampling_strategy="batch_rebalance"`` (``hf_sp_trainer.trainers.rebalance``) against the
same steps' examples in upstream's order (the same sampler, its grouping left as drawn) and against the Trainer's
default random sampler, on ``--dp x --sp`` gloo processes, side by side in one run (the variants alternate, each
``--repeats`` times). Per variant: the median step time, the per-step loss (the two samplers with the same steps must
log the same losses), and the cost model's imbalance (the slowest rank's FLOPs over an even share). Then the cost
model alone at larger ``dp`` (no training). Writes ``balance.csv``, ``balance.json`` and ``balance.png`` to ``--out``.

The document lengths are synthetic: log-normal with median ``--median`` tokens and shape ``--sigma``, clipped to
``[--min-len, --max-len]`` (a long tail: most documents short, a few 10-30x the median). The parameters are this
benchmark's, not fitted to a dataset.

On a 2-core machine run ``--dp 2 --sp 1`` (a core per rank): with more processes than cores a rank that waits frees
its core for the slow group and the balance stops showing in the step time. For more ranks than cores (``--dp 2 --sp
2`` here) read ``busiest_cpu_s``: per step, the CPU seconds of the rank that worked most (its own compute and
communication, not its waits), the median over steps -- what the step would take on a core per rank, less the waits
it causes; a proxy, not a step time.

    python scripts/bench_balance.py --dp 2 --sp 1 --steps 12 --repeats 2 --out docs/benchmarks/balance
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp
from _bench_common import MODEL_META, VOCAB, bench_llama, end_spawned_worker, free_port, pyplot, write_table

VARIANTS = ("balanced", "same_steps_unbalanced", "random")


def documents(args, count: int | None = None) -> list[dict]:
    """``count`` documents (default: the run's ``dp x batch x ga x steps``) of long-tail lengths, random tokens."""
    rng = random.Random(args.seed)
    lengths = [
        max(args.min_len, min(args.max_len, int(rng.lognormvariate(math.log(args.median), args.sigma))))
        for _ in range(count or args.dp * args.batch * args.ga * args.steps)
    ]
    return [{"input_ids": [rng.randrange(3, VOCAB) for _ in range(n)]} for n in lengths]


def _trainer(variant: str, args, data, out_dir: str):
    from transformers import TrainerCallback

    from hf_sp_trainer import SPTrainer, TrainingArguments
    from hf_sp_trainer.collators import SPDataCollator
    from hf_sp_trainer.trainers import rebalance

    class StepTimes(TrainerCallback):
        """Per step: wall seconds, and this process's CPU seconds (its own work, not its waits on other ranks)."""

        def __init__(self):
            self.times: list[float] = []
            self.cpu: list[float] = []

        def on_step_begin(self, *a, **k):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.start)
            self.cpu.append(time.process_time() - self.cpu_start)

    training = TrainingArguments(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.ga, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, use_cpu=True, ddp_backend="gloo", sp_size=args.sp,
        remove_unused_columns=False, dataloader_num_workers=0, sp_throughput_logging=False,
        train_sampling_strategy="random" if variant == "random" else "batch_rebalance",
    )  # fmt: skip
    trainer = SPTrainer(
        model=bench_llama(args.kv_heads), args=training, train_dataset=data, data_collator=SPDataCollator()
    )
    if variant == "same_steps_unbalanced":  # the step's examples in upstream's order, dealt as drawn
        original = rebalance.DocumentRebalanceSampler.balanced_micro_batches

        def as_drawn(self, indices):
            dp, groups = self.dp_size, rebalance._split_evenly(indices, self.dp_size * self.grad_accum)
            return [groups[s * dp : (s + 1) * dp] for s in range(self.grad_accum)]

        rebalance.DocumentRebalanceSampler.balanced_micro_batches = as_drawn
        trainer._restore = lambda: setattr(rebalance.DocumentRebalanceSampler, "balanced_micro_batches", original)
    timer = StepTimes()
    trainer.add_callback(timer)
    return trainer, timer


def _worker(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    data = documents(args)
    rows = []
    for repeat in range(args.repeats):
        for variant in VARIANTS:
            trainer, timer = _trainer(variant, args, data, tempfile.mkdtemp(prefix="bench_balance_"))
            trainer.train()
            getattr(trainer, "_restore", lambda: None)()
            losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
            steady = timer.times[1:]  # the first step warms up
            rows.append({"variant": variant, "repeat": repeat, "step_s": statistics.median(steady),
                         "cpu_s": timer.cpu, "steps": len(timer.times), "losses": losses})  # fmt: skip
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(rows, f)
    end_spawned_worker()


def modeled(args, dp: int, ga: int) -> dict:
    """The cost model's view of one epoch: the slowest rank's FLOPs over an even share, per step, averaged."""
    from hf_sp_trainer.trainers.rebalance import DocumentRebalanceSampler, _split_evenly, document_flops

    data = documents(args, 2000 * args.batch)
    cost = document_flops(bench_llama(args.kv_heads))
    size = dp * args.batch * ga
    sampler = DocumentRebalanceSampler([[len(d["input_ids"])] for d in data], cost, size, dp, ga, 0)
    ours, plain, bound = [], [], []
    for step in range(len(data) // size):
        indices = list(range(step * size, (step + 1) * size))
        share = sum(sampler.costs[i] for i in indices) / dp
        per_rank = sampler._assign(indices, [])
        groups = _split_evenly(indices, dp * ga)
        ours.append(max(sum(sampler.costs[i] for g in mbs for i in g) for mbs in per_rank) / share)
        drawn = [groups[r * ga : (r + 1) * ga] for r in range(dp)]
        plain.append(max(sum(sampler.costs[i] for g in mbs for i in g) for mbs in drawn) / share)
        bound.append(max(share, max(sampler.costs[i] for i in indices)) / share)
    mean = statistics.mean
    return {"dp": dp, "ga": ga, "balanced": mean(ours), "as_drawn": mean(plain), "bound": mean(bound)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4, help="documents per row (per rank and micro-step)")
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--median", type=float, default=192)
    parser.add_argument("--sigma", type=float, default=1.1)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench_balance")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    world = args.dp * args.sp
    raw = os.path.join(tempfile.mkdtemp(prefix="bench_balance_"), "raw.json")
    mp.spawn(_worker, args=(world, free_port(), args, raw), nprocs=world)
    per_rank = []
    for rank in range(world):
        with open(f"{raw}.{rank}") as f:
            per_rank.append(json.load(f))
    runs = per_rank[0]
    for i, run in enumerate(runs):  # per step, the busiest rank's CPU seconds; steady steps (the first warms up)
        busiest = [max(ranks) for ranks in zip(*(r[i]["cpu_s"] for r in per_rank), strict=True)]
        run["busiest_cpu_s"] = statistics.median(busiest[1:])
    rows = []
    for variant in VARIANTS:
        picked = [r for r in runs if r["variant"] == variant]
        rows.append({"variant": variant, "step_s": statistics.median(r["step_s"] for r in picked),
                     "busiest_cpu_s": statistics.median(r["busiest_cpu_s"] for r in picked),
                     "runs": [round(r["step_s"], 4) for r in picked], "losses": picked[0]["losses"]})  # fmt: skip
    base = next(r for r in rows if r["variant"] == "same_steps_unbalanced")
    for row in rows:
        row["time_vs_unbalanced"] = row["step_s"] / base["step_s"]
        row["busiest_cpu_vs_unbalanced"] = row["busiest_cpu_s"] / base["busiest_cpu_s"]
    same = rows[0]["losses"] == base["losses"] or max(
        abs(a - b) / abs(b) for a, b in zip(rows[0]["losses"], base["losses"], strict=True)
    )
    model_rows = [modeled(args, dp, ga) for dp in (2, 4, 8) for ga in (1, 4)]
    meta = {"args": vars(args), "model": MODEL_META, "cpu_count": os.cpu_count(), "losses_equal": same,
            "modeled": model_rows}  # fmt: skip
    write_table(args.out, "balance", [{k: v for k, v in r.items() if k != "losses"} for r in rows], meta | {
        "losses": {r["variant"]: r["losses"] for r in rows}})  # fmt: skip
    for row in rows:
        wall = f"{row['step_s']:.3f} s/step ({row['time_vs_unbalanced']:.2f}x) runs {row['runs']}"
        cpu = f"{row['busiest_cpu_s']:.3f} s/step ({row['busiest_cpu_vs_unbalanced']:.2f}x)"
        print(f"{row['variant']:>22}: {wall}; busiest rank's CPU {cpu}")
    print("balanced vs same steps unbalanced, per-step losses: relative difference", same)
    for m in model_rows:
        print(f"model dp {m['dp']} ga {m['ga']}: slowest rank / even share: balanced {m['balanced']:.3f}, "
              f"as drawn {m['as_drawn']:.3f}, bound {m['bound']:.3f}")  # fmt: skip
    _plot(rows, model_rows, args)


def _plot(rows, model_rows, args) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar([r["variant"] for r in rows], [r["step_s"] for r in rows])
    axes[0].set_title(f"step time (s), dp {args.dp} x sp {args.sp}, {args.batch} docs/row, ga {args.ga}")
    labels = [f"dp{m['dp']} ga{m['ga']}" for m in model_rows]
    for key in ("as_drawn", "balanced", "bound"):
        axes[1].plot(labels, [m[key] for m in model_rows], marker="o", label=key)
    axes[1].set_title("cost model: slowest rank / even share")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "balance.png"), dpi=120)


if __name__ == "__main__":
    main()
