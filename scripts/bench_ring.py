"""Benchmark: Ulysses vs Ulysses x Ring vs Ring at the same sp: step time, peak memory, bytes sent, zigzag balance.

    python scripts/bench_ring.py --sp 2 4 --lengths 4096 8192 --doc-sizes 0 512 --kv-heads 2 --repeats 3

(doc size 0 = one document per row, otherwise packed documents of that size). For every ``sp`` of ``--sp``, ``sp``
spawned CPU processes (gloo) run every split ``sp = U x R`` (``R = 1 .. sp``: Ulysses only, hybrids, ring only) of
a random-init Llama (hidden 256, 8 query heads, ``--kv-heads`` kv heads, 4 layers, vocab 1024, fp32, sdpa) on one
row per length and doc size:

1. step time: median of ``--repeats`` forward + backward steps after one warm-up step; peak memory per rank: VmHWM
   of the last step (reset before it, glibc told to return freed memory);
2. bytes sent per rank in the warm-up step, counted by a ``TorchDispatchMode`` on the dispatcher ops. On gloo the
   Ulysses forward all-to-all shows up as the project's ``hf_sp_trainer.all_to_all`` (a custom op: the mode does not
   see the ``c10d.alltoall_base_`` inside it), its backward as ``c10d.alltoall_base_``; ``batch_isend_irecv`` as
   one ``c10d.send`` + ``c10d.recv_`` per shift; the document-boundary gathers as ``c10d.allgather_`` ("other").
   All-to-all: ``(W-1)/W`` of the input is sent; send: the tensors; all-gather: the input ``W-1`` times.
3. per-rank attention time of a ring, zigzag vs contiguous, in this process: every rank's block tasks of
   ``zigzag.plan_ring(..., layout=...)`` for one layer (ring-only heads) run with ``block_forward`` +
   ``block_backward`` on random tensors (1 thread, median of ``--repeats``), next to ``zigzag.measure_work``'s
   visible-pair counts.

Theory, per rank and step (``S`` the padded length, ``n = S/sp`` local tokens, ``d`` head dim, ``H`` query heads,
``L`` layers, ``e = 4`` bytes (fp32 activations), ``a = 4`` bytes (fp32 dK/dV accumulators), ``K' = lcm(kv, U)``
kv heads after Ulysses' replication):

    Ulysses  = 2 L (U-1)/U e n d (2H + 2K')            q, k, v, out all-to-alls forward + their gradients' backward
    Ring     = L B (2 (R-1) e + R a),  B = 2 (K'/U) (S/R) d      K/V blocks R-1 times forward and backward,
                                                                 dK/dV accumulators R times in backward
    Hybrid   = Ulysses + Ring
    other    = (sp-1) 8 (3 + n)                        int64 shape check + position ids all-gathers, per forward

Writes ``ring.csv``/``ring.json`` (1, 2), ``ring_balance.csv``/``ring_balance.json`` (3) and ``ring.png`` to
``--out`` and prints markdown tables for the README.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _bench_common import (
    HEADS,
    HIDDEN,
    LAYERS,
    MODEL_META,
    bench_llama,
    end_spawned_worker,
    free_port,
    packed_row,
    peak_mb,
    pyplot,
    reset_peak,
    set_malloc_env,
    write_table,
)
from torch.utils._python_dispatch import TorchDispatchMode

HEAD_DIM, ELEM, ACC = HIDDEN // HEADS, 4, 4
A2A_OPS = ("hf_sp_trainer.all_to_all", "hf_sp_trainer.all_to_all_packed", "c10d.alltoall_base_")
ATTN_OPS = (*A2A_OPS, "c10d.send", "ring_shift")  # recv_ is counted as received, not sent


def _cases(args) -> list[tuple[int, int]]:
    return [(length, doc) for length in args.lengths for doc in args.doc_sizes if doc < length]


def _splits(sp: int) -> list[int]:
    """Ring sizes of every ``sp = U x R`` whose Ulysses degree divides the query heads."""
    return [r for r in range(1, sp + 1) if sp % r == 0 and HEADS % (sp // r) == 0]


class CommCounter(TorchDispatchMode):
    """Bytes this rank sends (and receives by ``recv_``) per collective op, from the dispatcher's view, plus the ring's
    K/V and dK/dV shifts (inside the ring attention op, where the mode does not see: counted at ``ring_shift``)."""

    active: CommCounter | None = None

    def __init__(self):
        super().__init__()
        self.sent, self.calls = collections.Counter(), collections.Counter()

    def __enter__(self):
        CommCounter.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        CommCounter.active = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

        name = str(func).rsplit(".", 1)[0]
        if name == "hf_sp_trainer.all_to_all":  # (x, scatter_dim, gather_dim, group_name)
            world = _resolve_process_group(args[3]).size()
            self.sent[name] += args[0].nbytes * (world - 1) // world
        elif name == "hf_sp_trainer.all_to_all_packed":  # (x [world, ...], group_name): q, k and v in one
            self.sent[name] += args[0].nbytes * (args[0].shape[0] - 1) // args[0].shape[0]
        elif name == "c10d.alltoall_base_":  # (output, input, group, output_splits, input_splits, ...)
            if args[3] or args[4]:
                raise NotImplementedError("uneven all-to-all splits")
            world = ProcessGroup.unbox(args[2]).size()
            self.sent[name] += args[1].nbytes * (world - 1) // world
        elif name in ("c10d.send", "c10d.recv_"):  # (tensors, group, peer, tag)
            self.sent[name] += sum(t.nbytes for t in args[0])
        elif name == "c10d.allgather_":  # (output lists, inputs, group, ...)
            self.sent[name] += sum(t.nbytes for t in args[1]) * (len(args[0][0]) - 1)
        elif name.startswith("c10d."):
            self.sent[name] += 0  # unexpected: listed with its call count
        if name.startswith(("c10d.", "hf_sp_trainer.")):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _count_ring_shifts() -> None:
    """Wrap the ring's send/recv primitive so that each shift's bytes (what goes to the next rank) are counted."""
    from hf_sp_trainer.attention import ring

    original = ring.ring_shift

    def counted(tensor, group, tag):
        if CommCounter.active is not None:
            CommCounter.active.sent["ring_shift"] += tensor.nbytes
            CommCounter.active.calls["ring_shift"] += 1
        return original(tensor, group, tag)

    ring.ring_shift = counted


def theory_bytes(seq_len: int, sp: int, ring: int, kv_heads: int) -> dict[str, int]:
    """Bytes sent per rank per step (padded ``seq_len``), by the formulas of the module docstring."""
    u, n = sp // ring, seq_len // sp
    kv_u = math.lcm(kv_heads, u)  # kv heads after Ulysses' replication
    ulysses = 2 * LAYERS * (u - 1) * ELEM * n * HEAD_DIM * (2 * HEADS + 2 * kv_u) // u
    block = 2 * (kv_u // u) * (seq_len // ring) * HEAD_DIM  # elements of one stacked K/V ring message
    ring_bytes = LAYERS * block * (2 * (ring - 1) * ELEM + ring * ACC) if ring > 1 else 0
    return {"ulysses": ulysses, "ring": ring_bytes, "other": (sp - 1) * 8 * (3 + n)}


def _step(model, shard, length: int) -> None:
    model.zero_grad(set_to_none=True)
    model(**shard, num_items_in_batch=torch.tensor(length)).loss.backward()


def _worker(rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    _count_ring_shifts()
    from hf_sp_trainer import apply_sequence_parallel

    model = bench_llama(args.kv_heads)
    for ring in _splits(world):
        sp = apply_sequence_parallel(model, world, ring_size=ring, attn_implementation="sdpa")
        for length, doc in _cases(args):
            shard = sp.shard_batch(packed_row(length, doc))
            with CommCounter() as counter:  # the warm-up step, counted
                _step(model, shard, length)
            times = []
            for _ in range(args.repeats):
                dist.barrier()
                reset_peak()
                start = time.perf_counter()
                _step(model, shard, length)
                dist.barrier()
                times.append(time.perf_counter() - start)
            mine = {"step_s": statistics.median(times), "peak_mb": peak_mb(), "sent": dict(counter.sent),
                    "calls": dict(counter.calls)}  # fmt: skip
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                results.append(_result(world, ring, length, doc, shard, gathered, args))
        sp.remove()
    end_spawned_worker()


def _result(sp, ring, length, doc, shard, ranks, args) -> dict:
    seq_len = shard["input_ids"].shape[1] * sp  # padded
    theory = theory_bytes(seq_len, sp, ring, args.kv_heads)
    attn = [sum(v for k, v in r["sent"].items() if k in ATTN_OPS) for r in ranks]
    recv = [r["sent"].get("ring_shift", 0) for r in ranks]  # a ring receives what it sends
    other = [sum(v for k, v in r["sent"].items() if k not in (*ATTN_OPS, "c10d.recv_")) for r in ranks]
    attn_theory = theory["ulysses"] + theory["ring"]
    return {
        "sp": sp, "ulysses": sp // ring, "ring": ring, "length": length, "padded": seq_len,
        "doc_size": doc or length, "docs": math.ceil(length / (doc or length)),
        "step_s": ranks[0]["step_s"], "peak_mb": max(r["peak_mb"] for r in ranks),
        "peak_mb_ranks": "/".join(f"{r['peak_mb']:.0f}" for r in ranks),
        "attn_sent_mb": max(attn) / 2**20, "attn_theory_mb": attn_theory / 2**20,
        "attn_ratio": max(attn) / attn_theory if attn_theory else float(max(attn) == 0),
        "attn_ratio_min": min(attn) / attn_theory if attn_theory else float(min(attn) == 0),
        "ulysses_theory_mb": theory["ulysses"] / 2**20, "ring_theory_mb": theory["ring"] / 2**20,
        "ring_recv_mb": max(recv) / 2**20,
        "other_sent_kb": max(other) / 2**10, "other_theory_kb": theory["other"] / 2**10,
        "other_ratio": max(other) / theory["other"],
        "ops": " ".join(f"{k}x{v}" for k, v in sorted(ranks[0]["calls"].items())),
    }  # fmt: skip


# -- 3. zigzag vs contiguous: per-rank block work of one layer, in this process ------------------------------------
def _rank_seconds(plans: list, kv_heads: int, repeats: int) -> list[float]:
    """Median time of every rank's block tasks (forward + backward), ranks interleaved within each repeat."""
    from hf_sp_trainer.attention.block_attention import block_backward, block_forward

    n, g = plans[0].seq_len // plans[0].ring_size, torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, n, HEAD_DIM, generator=g)
    k, v = (torch.randn(1, kv_heads, n, HEAD_DIM, generator=g) for _ in range(2))
    times = [[] for _ in plans]
    for _ in range(repeats + 1):  # the first one warms up
        for plan, rank_times in zip(plans, times, strict=True):
            start = time.perf_counter()
            for task in (task for step in plan.steps for task in step):
                qs, ks = (slice(None), slice(None), slice(*task.q)), (slice(None), slice(None), slice(*task.k))
                kw = dict(kind=task.kind, scale=HEAD_DIM**-0.5, offset=task.offset, docs=task.docs)
                out, lse = block_forward(q[qs], k[ks], v[ks], **kw)
                block_backward(torch.ones_like(out), q[qs], k[ks], v[ks], out, lse, **kw)
            rank_times.append(time.perf_counter() - start)
    return [statistics.median(t[1:]) for t in times]


def balance(args, rings: list[int]) -> list[dict]:
    from hf_sp_trainer.documents import DocumentLayout
    from hf_sp_trainer.sharding import pad_to_multiple
    from hf_sp_trainer.sharding.zigzag import measure_work, plan_ring

    rows, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # one core per ring rank, as the workers (and steadier on a shared machine)
    for ring in rings:
        for length, doc in _cases(args):
            position_ids = pad_to_multiple(packed_row(length, doc), 2 * ring)["position_ids"]
            segments, seq_len = DocumentLayout.from_position_ids(position_ids).segments, position_ids.shape[1]
            for layout in ("zigzag", "contiguous"):
                pairs = [w.pairs for w in measure_work(segments, seq_len, ring, layout=layout)]
                plans = [plan_ring(segments, seq_len, ring, r, layout=layout) for r in range(ring)]
                secs = _rank_seconds(plans, args.kv_heads, args.repeats)
                rows.append({
                    "ring": ring, "length": length, "doc_size": doc or length,
                    "docs": math.ceil(length / (doc or length)), "layout": layout,
                    "pairs_max_mean": max(pairs) / statistics.mean(pairs), "pairs_max_min": max(pairs) / min(pairs),
                    "time_max_mean": max(secs) / statistics.mean(secs), "time_max_min": max(secs) / min(secs),
                    "rank_ms": "/".join(f"{1e3 * s:.1f}" for s in secs), "rank_pairs": "/".join(map(str, pairs)),
                })  # fmt: skip
    torch.set_num_threads(threads)
    return rows


# -- output ---------------------------------------------------------------------------------------------------------
def markdown(rows: list[dict], spread: list[dict]) -> str:
    lines = [
        "| sp | U x R | length | docs | step (s) | peak MB/rank | attn MB sent/rank | theory | ratio | other KB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['sp']} | {r['ulysses']} x {r['ring']} | {r['length']} | {r['docs']} | {r['step_s']:.2f} | "
            f"{r['peak_mb_ranks']} | {r['attn_sent_mb']:.2f} | {r['attn_theory_mb']:.2f} | {r['attn_ratio']:.2f} | "
            f"{r['other_sent_kb']:.1f} |"
        )
    lines += [
        "",
        "| ring | length | docs | layout | pairs max/mean | time max/mean | time max/min | per-rank ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in spread:
        lines.append(
            f"| {r['ring']} | {r['length']} | {r['docs']} | {r['layout']} | {r['pairs_max_mean']:.2f} | "
            f"{r['time_max_mean']:.2f} | {r['time_max_min']:.2f} | {r['rank_ms']} |"
        )
    return "\n".join(lines)


def _bars(ax, groups: list[str], series: dict[str, list[float]], title: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], groups, rotation=30, fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def plot(rows: list[dict], spread: list[dict], args) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    cases = [f"{length}/{docs}d" for length, docs in dict.fromkeys((r["length"], r["docs"]) for r in rows)]
    configs = list(dict.fromkeys((r["sp"], r["ulysses"], r["ring"]) for r in rows))

    def series(key):
        return {
            f"sp{s} {u}x{r}": [x[key] for x in rows if (x["sp"], x["ulysses"], x["ring"]) == (s, u, r)]
            for s, u, r in configs
        }

    _bars(axes[0], cases, series("step_s"), "step time (s), forward + backward")
    _bars(axes[1], cases, series("peak_mb"), "peak memory (MB, VmHWM), max over ranks")
    _bars(axes[2], cases, series("attn_sent_mb"), f"attention MB sent per rank per step (kv heads {args.kv_heads})")
    for x, (s, u, r) in enumerate(configs):  # theory as black ticks over each bar
        width = 0.8 / len(configs)
        theory = [y["attn_theory_mb"] for y in rows if (y["sp"], y["ulysses"], y["ring"]) == (s, u, r)]
        axes[2].scatter([c + x * width for c in range(len(cases))], theory, marker="_", color="k", s=60)
    groups = list(dict.fromkeys(f"R{r['ring']} {r['length']}/{r['docs']}d" for r in spread))
    _bars(axes[3], groups, {lay: [r["time_max_mean"] for r in spread if r["layout"] == lay]
                            for lay in ("zigzag", "contiguous")}, "ring attention per-rank time max/mean")  # fmt: skip
    axes[3].axhline(1.0, color="k", lw=0.5)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "ring.png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--doc-sizes", type=int, nargs="+", default=[0, 512])
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks/ring")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    set_malloc_env()  # inherited by the workers
    rows = []
    for sp in args.sp:
        with mp.Manager() as manager:
            results = manager.list()
            mp.spawn(_worker, args=(sp, free_port(), args, results), nprocs=sp)
            rows += list(results)
    for r in rows:
        print(f"sp {r['sp']} = {r['ulysses']} x {r['ring']} len {r['length']} docs {r['docs']}: {r['step_s']:.2f} s, "
              f"attn sent {r['attn_sent_mb']:.3f} MB vs theory {r['attn_theory_mb']:.3f} (ratio {r['attn_ratio']:.3f},"
              f" min rank {r['attn_ratio_min']:.3f}), other {r['other_sent_kb']:.2f} KB (x{r['other_ratio']:.2f}); "
              f"{r['ops']}")  # fmt: skip
    rings = sorted({r for sp in args.sp for r in _splits(sp) if r > 1})
    spread = balance(args, rings)
    meta = {"model": {**MODEL_META, "kv_heads": args.kv_heads},
            "dtype": "float32", "attn": "sdpa", "cpus": os.cpu_count(), "args": vars(args)}  # fmt: skip
    write_table(args.out, "ring", rows, meta)
    write_table(args.out, "ring_balance", spread, meta)
    plot(rows, spread, args)
    print(markdown(rows, spread))


if __name__ == "__main__":
    main()
