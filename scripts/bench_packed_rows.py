"""Benchmark: does a packed row cost more than an unpacked row of the same length under Ulysses SP?

Runs one forward + backward of a small Llama-style model on ``--sp`` CPU processes (gloo) for each sequence length
and document size, and records per-rank step time and peak memory (VmHWM after clearing it, glibc told to return
freed memory). Writes ``packed_rows.csv``, ``packed_rows.json`` and ``packed_rows.png`` to ``--out``.

    python scripts/bench_packed_rows.py --sp 2 --lengths 2048 4096 8192 --doc-sizes 0 2048 256 32
(doc size 0 = one unpacked document).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _bench_common import (
    bench_llama,
    end_spawned_worker,
    free_port,
    packed_row,
    peak_mb,
    reset_peak,
    set_malloc_env,
)


def _worker(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    from hf_sp_trainer import apply_sequence_parallel

    model = bench_llama(4, attn=args.attn)
    sp = apply_sequence_parallel(model, world, attn_implementation=args.attn)
    rows = []
    for length in args.lengths:
        for doc_size in [d for d in args.doc_sizes if d < length]:
            shard = sp.shard_batch(packed_row(length, doc_size))
            times = []
            for repeat in range(args.repeats + 1):  # first run warms up
                model.zero_grad(set_to_none=True)
                dist.barrier()
                reset_peak()
                start = time.perf_counter()
                loss = model(**shard, num_items_in_batch=torch.tensor(length)).loss
                loss.backward()
                dist.barrier()
                if repeat:
                    times.append(time.perf_counter() - start)
            rows.append(
                {
                    "length": length,
                    "doc_size": doc_size or length,
                    "docs": length // (doc_size or length),
                    "step_s": min(times),
                    "peak_mb": peak_mb(),
                }
            )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    end_spawned_worker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--doc-sizes", type=int, nargs="+", default=[0, 2048, 256, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="runs/bench_packed_rows")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    set_malloc_env()  # inherited by the workers
    port = free_port()
    raw = os.path.join(args.out, "raw.json")
    mp.spawn(_worker, args=(args.sp, port, args, raw), nprocs=args.sp)
    with open(raw) as f:
        rows = json.load(f)
    for row in rows:  # relative to the unpacked row of the same length
        base = next(r for r in rows if r["length"] == row["length"] and r["docs"] == 1)
        row["time_vs_unpacked"] = row["step_s"] / base["step_s"]
        row["peak_vs_unpacked"] = row["peak_mb"] / base["peak_mb"]
    with open(os.path.join(args.out, "packed_rows.json"), "w") as f:
        json.dump({"sp": args.sp, "attn": args.attn, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "packed_rows.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(
            f"len {row['length']:>6} docs {row['docs']:>4}: {row['step_s']:.3f} s ({row['time_vs_unpacked']:.2f}x), "
            f"peak {row['peak_mb']:.0f} MB ({row['peak_vs_unpacked']:.2f}x)"
        )
    _plot(rows, args)


def _plot(rows, args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for docs_label in sorted({r["doc_size"] for r in rows if r["docs"] > 1}) + [None]:
        pick = [
            r for r in rows if (r["docs"] == 1 if docs_label is None else r["doc_size"] == docs_label and r["docs"] > 1)
        ]
        label = "unpacked" if docs_label is None else f"docs of {docs_label}"
        axes[0].plot([r["length"] for r in pick], [r["step_s"] for r in pick], marker="o", label=label)
        axes[1].plot([r["length"] for r in pick], [r["peak_mb"] for r in pick], marker="o", label=label)
    for ax, title in zip(axes, ("step time (s)", "peak memory per rank (MB)"), strict=True):
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(f"{title}, sp={args.sp}, {args.attn}")
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "packed_rows.png"), dpi=120)


if __name__ == "__main__":
    main()
