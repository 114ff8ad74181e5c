"""Benchmark: ``torch.compile`` (inductor) of the decoder layers under SP vs eager, on CPU.

    python scripts/bench_compile.py --sp 2 --lengths 2048 4096 8192

Runs the same random-init Llama (4 layers, hidden 256, 8 heads, kv heads 2, fp32) on ``--sp`` gloo processes with
``apply_sequence_parallel``, once eager and once with ``compile_decoder_layers`` (inductor, ``dynamic=True``), over
one-document rows of each length (one compilation serves every length: dynamic shapes). Per length: median
forward+backward time over ``--repeats`` after a warm-up, the compile time (first step), dynamo's graph-break and
graph counts, and the max relative gradient difference compiled vs eager. Writes ``compile.csv`` / ``compile.json``
to ``--out`` (default docs/benchmarks/compile) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _bench_common import bench_llama, end_spawned_worker, free_port, packed_row, write_table


def _step(model, sp, length: int) -> tuple[float, dict[str, torch.Tensor]]:
    shard = sp.shard_batch(packed_row(length))
    model.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    model(**shard, num_items_in_batch=torch.tensor(length - 1)).loss.backward()
    dist.barrier()
    return time.perf_counter() - start, {n: p.grad for n, p in model.named_parameters()}


def _worker(rank: int, world: int, port: int, opts, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    from torch._dynamo.utils import counters

    from hf_sp_trainer import apply_sequence_parallel
    from hf_sp_trainer.parallel import compile_decoder_layers

    rows, grads = [], {}
    for mode in ("eager", "inductor"):
        model = bench_llama(2)
        sp = apply_sequence_parallel(model, world)
        if mode == "inductor":
            counters.clear()
            compile_decoder_layers(model, backend="inductor")
        for length in opts.lengths:
            first, _ = _step(model, sp, length)  # warm-up (compilation, the first time)
            times = []
            for _ in range(opts.repeats):
                seconds, g = _step(model, sp, length)
                times.append(seconds)
            if mode == "eager":
                grads[length] = {n: t.clone() for n, t in g.items()}
                diff = 0.0
            else:
                ref = grads[length]
                diff = max(float((g[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-30)) for n in ref)
            rows.append({"mode": mode, "length": length, "step_s": statistics.median(times), "first_step_s": first,
                         "grad_rel_diff_vs_eager": diff})  # fmt: skip
        sp.remove()
    if rank == 0:
        out["rows"] = rows
        out["graph_breaks"] = sum(counters["graph_break"].values())
        out["unique_graphs"] = counters["stats"]["unique_graphs"]
    end_spawned_worker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks/compile")
    opts = parser.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(opts.sp, free_port(), opts, out), nprocs=opts.sp)
        result = dict(out)
    rows = result["rows"]
    eager = {r["length"]: r["step_s"] for r in rows if r["mode"] == "eager"}
    for r in rows:
        r["speedup_vs_eager"] = eager[r["length"]] / r["step_s"]
    meta = {k: result[k] for k in ("graph_breaks", "unique_graphs")} | {"sp": opts.sp, "threads": os.cpu_count(),
                                                                         "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    write_table(opts.out, "compile", rows, meta)
    print(f"graph breaks: {meta['graph_breaks']}, graphs compiled: {meta['unique_graphs']}\n")
    print("| tokens | eager step | inductor step | speedup | first compiled step | grad diff vs eager |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in opts.lengths:
        c = next(r for r in rows if r["mode"] == "inductor" and r["length"] == length)
        print(f"| {length} | {eager[length]:.2f} s | {c['step_s']:.2f} s | {c['speedup_vs_eager']:.2f}x | "
              f"{c['first_step_s']:.1f} s | {c['grad_rel_diff_vs_eager']:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
