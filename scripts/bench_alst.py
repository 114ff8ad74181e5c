"""Benchmark: ours vs DeepSpeed ALST Ulysses vs a single process, side by side, with the gradients checked.

    python scripts/bench_alst.py --lengths 2048 4096 8192 16384 --kv-heads 8 2 --repeats 3
    python scripts/bench_alst.py --profile 8192 16384 --kv-heads 8 2  # where a step's time and memory go

The same random-init Llama (4 layers, hidden 256, 8 heads, ``--kv-heads`` kv heads, intermediate 688, vocab 1024,
fp32, sdpa), the same tokens (one document per row, fixed seed) and the same optimizer step (forward + backward +
gradient all-reduce + AdamW), three ways, each in freshly spawned processes (gloo; ``--device cuda``: nccl on
``--sp`` GPUs, untested):

- ours: ``apply_sequence_parallel(model, sp, attn_implementation="sdpa")`` + ``sp.shard_batch`` + the model's loss
  with ``num_items_in_batch`` = the row's label count: each rank's exact share, so gradients are all-reduced with SUM;
- ALST: ``UlyssesSPAttentionHF.register_with_transformers`` (it replaces ``sdpa`` in transformers' attention
  registry) + the batch sharded as ``UlyssesSPDataLoaderAdapter.refill`` does (labels padded and shifted on the whole
  row, contiguous shards, ``position_ids`` per shard) + the loss of ``transformers.integrations.deepspeed.
  deepspeed_sp_compute_loss`` (local mean, weighted ``all_gather`` of losses and token counts). Its backward gives
  every rank ``sp x`` its share, so gradients are all-reduced with SUM / sp (what ZeRO's averaging does; ``sum_x``
  in the output is what a plain SUM would give). One document per row: with sdpa ALST drops the mask and runs plain
  causal attention over the gathered row, i.e. across the documents of a packed row;
- single: the plain model on the full row in 1 process with ``--single-threads`` threads (default: all cores, i.e.
  the cores the ``sp`` ranks share; each rank gets ``cores / sp``).

Per configuration: step time (median of ``--repeats`` after a warm-up step), per-rank peak memory (VmHWM after
``reset_peak``, glibc told to return freed memory; CUDA: ``max_memory_allocated``) and ``step_mb``, the peak above the
resident size at the start of the step; collective calls and bytes sent per rank in the warm-up step (a
``TorchDispatchMode``; it does not see inside custom ops, so ``hf_sp_trainer.all_to_all`` (``_packed``: q, k and v in
one) and ``deepspeed.dim_zero_all_to_all`` are counted as themselves: ``(W-1)/W`` of the input; all-gather: the input
``W-1`` times; all-reduce: ``2 (W-1)/W`` of it); the loss and the gradients of the warm-up step against the single
process (``grad_rel``: all parameters as one vector, ``grad_rel_tensor``: the worst tensor; every length starts from the
same weights). Writes ``alst.csv``, ``alst.json``, ``alst.png``, ``alst.md`` to ``--out``. ``--profile N [N ...]``: one
profiled step (torch.profiler, CPU) of ours and of ALST at each N tokens; rank 0's top ops by self CPU time, total CPU
time and self memory, and the copy/fill ops, printed and written to ``profile_*.txt``, and ``profile_floor.md``: each
method's self CPU time in SP communication (all-to-all / all-gather, forward and backward, waits included) and in
everything else, and the *floor*, ALST's step without its SP communication over its whole step: the ratio ours / ALST
would reach if our SP communication cost nothing while the model's own work stayed the same (an all-to-all's self time
includes waiting for the other rank; on a loaded machine compare calls and bytes rather than times).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time

import _bench_common as bench
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

SP_METHODS = ("ours", "alst")
COPY_OPS = tuple(f"aten::{op}" for op in "cat stack clone copy_ contiguous zeros fill_ repeat_interleave add_".split())
A2A_OPS = (
    "hf_sp_trainer.all_to_all",
    "hf_sp_trainer.all_to_all_packed",
    "deepspeed.dim_zero_all_to_all",
    "c10d.alltoall_base_",
)


def _sent_bytes(name: str, args) -> int:
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    if name == "hf_sp_trainer.all_to_all":  # (x, scatter_dim, gather_dim, group_name)
        world = _resolve_process_group(args[3]).size()
        return args[0].nbytes * (world - 1) // world
    if name in ("deepspeed.dim_zero_all_to_all", "hf_sp_trainer.all_to_all_packed"):  # (x [world, ...], group_name)
        return args[0].nbytes * (args[0].shape[0] - 1) // args[0].shape[0]
    if name == "c10d.alltoall_base_":  # (output, input, group, output_splits, input_splits, ...)
        world = ProcessGroup.unbox(args[2]).size()
        return args[1].nbytes * (world - 1) // world
    if name == "c10d.alltoall_":  # (outputs, inputs, group, ...): input j goes to rank j
        return sum(t.nbytes for t in args[1]) * (len(args[1]) - 1) // len(args[1])
    if name == "c10d.allgather_":  # (output lists, inputs, group, ...)
        return sum(t.nbytes for t in args[1]) * (len(args[0][0]) - 1)
    if name == "c10d.allreduce_":  # (tensors, group, op, ...): ring all-reduce
        world = ProcessGroup.unbox(args[1]).size()
        return 2 * sum(t.nbytes for t in args[0]) * (world - 1) // world
    if name == "c10d.reduce_scatter_":  # (outputs, input lists, group, ...)
        return sum(t.nbytes for t in args[1][0]) * (len(args[1][0]) - 1) // len(args[1][0])
    if name == "c10d.scatter_":  # (outputs, input lists (the root's), group, root, ...): the root sends W-1 of them
        return sum(t.nbytes for t in args[1][0][1:]) if args[1] and args[1][0] else 0
    return 0  # listed with its call count only


class CommCounter(TorchDispatchMode):
    """Collective calls and bytes this rank sends, per op, from the dispatcher's view."""

    def __init__(self):
        super().__init__()
        self.sent, self.calls = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).rsplit(".", 1)[0]
        if name.startswith("c10d.") or name in A2A_OPS:
            self.calls[name] += 1
            self.sent[name] += _sent_bytes(name, args)
        return func(*args, **(kwargs or {}))


# -- the three recipes: (batch preparation, loss, gradient scale after the SUM all-reduce) --------------------------
def _ours(model, world, device):
    from hf_sp_trainer import apply_sequence_parallel

    sp = apply_sequence_parallel(model, world, attn_implementation="sdpa")

    def prepare(row):
        count = torch.tensor(int((row["labels"][:, 1:] != -100).sum()), device=device)  # the whole row's labels
        return _to(sp.shard_batch(row), device), lambda m, b: m(**b, num_items_in_batch=count).loss

    return prepare, sp.topology.sp_group, 1.0


def _alst(model, world, device):
    import deepspeed.comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=1, seq_length_is_variable=True,
    )  # fmt: skip
    group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()

    def prepare(row):  # UlyssesSPDataLoaderAdapter.refill: shift on the whole row, then contiguous shards
        batch = dict(row)
        batch["shift_labels"] = F.pad(batch.pop("labels"), (0, 1), value=-100)[..., 1:].contiguous()
        chunk = batch["input_ids"].shape[1] // world
        shard = {k: v[:, chunk * sp_rank : chunk * (sp_rank + 1)] for k, v in batch.items()}
        shard["labels"] = shard["shift_labels"]  # deepspeed_sp_compute_loss: the model's loss needs "labels"
        return _to(shard, device), lambda m, b: _alst_loss(m, b, group)

    return prepare, group, 1.0 / world


def _alst_loss(model, batch, group):
    """transformers.integrations.deepspeed.deepspeed_sp_compute_loss: the token-weighted mean of the local means."""
    from torch.distributed.nn.functional import all_gather

    loss = model(**batch).loss
    losses = torch.stack(all_gather(loss, group=group))
    good = torch.stack(all_gather((batch["shift_labels"] != -100).view(-1).sum(), group=group))
    safe = torch.where(good > 0, losses, torch.zeros_like(losses))
    return (safe * good).sum() / good.sum().clamp(min=1)


def _single(model, world, device):
    return (lambda row: (_to(row, device), lambda m, b: m(**b).loss)), None, 1.0


def _to(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


# -- one step, memory, workers ----------------------------------------------------------------------------------
def _step(model, opt, batch, loss_fn, group, scale, capture=None):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    if group is not None:  # one bucket, as DDP / ZeRO would reduce it
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat.mul_(scale), grads), strict=True):
            g.copy_(r)
    if capture is not None:
        capture.update({n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None})
    opt.step()
    return loss.detach()


def _mem_reset(device) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    bench.reset_peak()
    return bench.rss_mb()


def _mem_peak(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.startswith("cuda") else bench.peak_mb()


def _sync(device, group) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group=group)


def _grad_diff(got: dict, ref: dict, scale: float) -> dict:
    names = list(ref)
    diff = sum(float((got[n] - ref[n]).pow(2).sum()) for n in names) ** 0.5
    norm = sum(float(ref[n].pow(2).sum()) for n in names) ** 0.5
    raw = sum(float(got[n].div(scale).pow(2).sum()) for n in names) ** 0.5  # after a plain SUM over the SP group
    worst = max(float((got[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-30)) for n in names)
    return {"grad_rel": diff / norm, "grad_rel_tensor": worst, "sum_x": raw / norm}


def _worker(rank, world, port, method, kv, args, ref_dir, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    cores = os.cpu_count() or 1
    threads = (args.single_threads or cores) if method == "single" else max(1, cores // world)
    torch.set_num_threads(threads)
    device = "cpu"
    if args.device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    if method != "single":
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    model = bench.bench_llama(kv, device=device)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    prepare, group, scale = {"ours": _ours, "alst": _alst, "single": _single}[method](model, world, device)
    for length in args.profile or args.lengths:
        model.load_state_dict(init)  # every length starts from the same weights, as the single process
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch, loss_fn = prepare(bench.packed_row(length))
        grads = {}
        _sync(device, group)
        with CommCounter() as counter:  # the warm-up step: counted, its gradients compared
            loss = _step(model, opt, batch, loss_fn, group, scale, capture=grads)
        if args.profile:
            results.append(_profile(model, opt, batch, loss_fn, group, scale, rank, method, kv, length, args))
            continue
        times = []
        for _ in range(args.repeats):
            _sync(device, group)
            base = _mem_reset(device)
            start = time.perf_counter()
            _step(model, opt, batch, loss_fn, group, scale)
            _sync(device, group)
            times.append(time.perf_counter() - start)
        peak = _mem_peak(device)
        ref_path = os.path.join(ref_dir, f"kv{kv}_{length}.pt")
        if method == "single":
            torch.save({"grads": grads, "loss": float(loss)}, ref_path)
            diffs, full_loss = {"grad_rel": 0.0, "grad_rel_tensor": 0.0, "sum_x": 1.0}, float(loss)
        else:
            ref = torch.load(ref_path)
            diffs = _grad_diff(grads, ref["grads"], scale)
            if method == "ours":  # each rank holds its share of the loss
                dist.all_reduce(loss, group=group)
            full_loss = float(loss)
            diffs["loss_rel"] = abs(full_loss - ref["loss"]) / abs(ref["loss"])
        mine = {"step_s": statistics.median(times), "peak_mb": peak, "step_mb": peak - base, "loss": full_loss,
                "sent": dict(counter.sent), "calls": dict(counter.calls), **diffs}  # fmt: skip
        ranks = [mine]
        if group is not None:
            ranks = [None] * world
            dist.all_gather_object(ranks, mine, group=group)
        if rank == 0:
            results.append(_result(method, kv, length, world, threads, ranks))
    bench.end_spawned_worker()


def _result(method, kv, length, world, threads, ranks) -> dict:
    def total(r, keep):
        return sum(v for k, v in r["sent"].items() if keep(k))

    r0 = ranks[0]
    return {
        "method": method, "kv_heads": kv, "length": length, "procs": world, "threads_per_proc": threads,
        "step_s": max(r["step_s"] for r in ranks), "peak_mb": max(r["peak_mb"] for r in ranks),
        "step_mb": max(r["step_mb"] for r in ranks),
        "peak_mb_ranks": "/".join(f"{r['peak_mb']:.0f}" for r in ranks),
        "sent_mb": max(total(r, lambda k: True) for r in ranks) / 2**20,
        "a2a_mb": max(total(r, lambda k: k in A2A_OPS) for r in ranks) / 2**20,
        "grad_allreduce_mb": max(total(r, lambda k: k == "c10d.allreduce_") for r in ranks) / 2**20,
        "other_kb": max(total(r, lambda k: k not in (*A2A_OPS, "c10d.allreduce_")) for r in ranks) / 2**10,
        "calls": sum(r0["calls"].values()),
        "grad_rel": max(r["grad_rel"] for r in ranks), "grad_rel_tensor": max(r["grad_rel_tensor"] for r in ranks),
        "sum_x": r0["sum_x"], "loss": r0["loss"], "loss_rel": r0.get("loss_rel", 0.0),
        "ops": " ".join(f"{k}x{v}" for k, v in sorted(r0["calls"].items())),
    }  # fmt: skip


# -- profile mode -----------------------------------------------------------------------------------------------
def _profile(model, opt, batch, loss_fn, group, scale, rank, method, kv, length, args) -> dict:
    from torch.autograd.profiler_util import EventList
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    _sync(args.device, group)
    with profile(activities=activities, profile_memory=True) as prof:
        _step(model, opt, batch, loss_fn, group, scale)
    table = prof.key_averages()
    sp_comm = sum(e.self_cpu_time_total for e in table if _is_sp_comm(e.key)) / 1e6
    times = {"method": method, "kv_heads": kv, "length": length, "rank": rank, "sp_comm_s": sp_comm,
             "total_s": sum(e.self_cpu_time_total for e in table) / 1e6}  # fmt: skip
    if rank != 0:
        return times
    copies = EventList([e for e in table if e.key in COPY_OPS], profile_memory=True)  # exact calls, bytes
    keys = ("self_cpu_time_total", "cpu_time_total", "self_cpu_memory_usage")
    if args.device == "cuda":
        keys += ("self_device_time_total", "self_device_memory_usage")
    text = "\n".join(
        f"== {method}, kv heads {kv}, {length} tokens, rank 0: {title} ==\n"
        + events.table(sort_by=key, row_limit=args.top, max_name_column_width=60)
        for title, events, key in [*((f"top {args.top} ops by {k}", table, k) for k in keys),
                                   ("copy / fill / layout ops", copies, "cpu_time_total")]
    )  # fmt: skip
    print(text, flush=True)
    with open(os.path.join(args.out, f"profile_{method}_kv{kv}_{length}.txt"), "w") as f:
        f.write(text)
    return times


def _is_sp_comm(key: str) -> bool:
    """The SP collectives (all-to-all, the all-gather of ALST's loss) and their backward; not the gradient
    all-reduce, which data parallelism does the same way."""
    return "all_to_all" in key or "allgather" in key or "all_gather" in key or key.startswith("c10d::alltoall")


def floor_table(rows: list[dict]) -> str:
    """Per kv heads and length (rank 0): step and SP-communication CPU seconds of ours and ALST, and the floor."""
    by = {(r["method"], r["kv_heads"], r["length"]): r for r in rows if r["rank"] == 0}
    lines = [
        "| kv | length | ours: step / SP comm (s) | ALST: step / SP comm (s) | ours / ALST "
        "| floor: ALST without SP comm |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kv, length in dict.fromkeys((r["kv_heads"], r["length"]) for r in rows):
        o, a = by.get(("ours", kv, length)), by.get(("alst", kv, length))
        if o and a:
            lines.append(
                f"| {kv} | {length} | {o['total_s']:.2f} / {o['sp_comm_s']:.2f} | {a['total_s']:.2f} / "
                f"{a['sp_comm_s']:.2f} | {o['total_s'] / a['total_s']:.2f} | "
                f"{(a['total_s'] - a['sp_comm_s']) / a['total_s']:.2f} |"
            )
    return "\n".join(lines)


# -- output -----------------------------------------------------------------------------------------------------
def markdown(rows: list[dict]) -> str:
    lines = [
        "| kv | length | step s ours / ALST / single | ours/ALST | peak MB ours / ALST / single (step MB) | "
        "ours/ALST step MB | MB sent ours / ALST (a2a) | grad rel ours / ALST | ALST with SUM |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    by = {(r["method"], r["kv_heads"], r["length"]): r for r in rows}
    for kv, length in dict.fromkeys((r["kv_heads"], r["length"]) for r in rows):
        o, a, s = (by.get((m, kv, length)) for m in ("ours", "alst", "single"))
        if not (o and a and s):
            continue
        lines.append(
            f"| {kv} | {length} | {o['step_s']:.3f} / {a['step_s']:.3f} / {s['step_s']:.3f} | "
            f"{o['step_s'] / a['step_s']:.2f} | {o['peak_mb']:.0f} / {a['peak_mb']:.0f} / {s['peak_mb']:.0f} "
            f"({o['step_mb']:.0f} / {a['step_mb']:.0f} / {s['step_mb']:.0f}) | {o['step_mb'] / a['step_mb']:.2f} | "
            f"{o['sent_mb']:.2f} / {a['sent_mb']:.2f} ({o['a2a_mb']:.2f} / {a['a2a_mb']:.2f}) | "
            f"{o['grad_rel']:.1e} / {a['grad_rel']:.1e} | x{a['sum_x']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], out: str) -> None:
    plt = bench.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    panels = (("step_s", "step time (s)"), ("step_mb", "step peak above resident (MB), max rank"),
              ("sent_mb", "MB sent per rank per step"), ("grad_rel", "gradient rel. diff vs single"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, (method, kv) in enumerate(dict.fromkeys((r["method"], r["kv_heads"]) for r in rows)):
            pick = [r for r in rows if (r["method"], r["kv_heads"]) == (method, kv)]
            if key in ("sent_mb", "grad_rel") and method == "single":
                continue
            ax.plot([r["length"] for r in pick], [max(r[key], 1e-12) for r in pick], marker="ovs^dx"[i % 6],
                    color=f"C{i}", label=f"{method} kv{kv}")  # fmt: skip
        ax.set(xscale="log", xlabel="tokens", title=title, yscale="log" if key == "grad_rel" else "linear")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "alst.png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--single-threads", type=int, default=0, help="threads of the single process (0: all cores)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--profile", type=int, nargs="*", default=[], help="profile ours and ALST at these lengths")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default="docs/benchmarks/alst")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bench.set_malloc_env()  # inherited by the workers
    rows = []
    with tempfile.TemporaryDirectory() as ref_dir, mp.Manager() as manager:
        for kv in args.kv_heads:
            for method in SP_METHODS if args.profile else ("single", *SP_METHODS):  # single first: the reference
                results, world = manager.list(), 1 if method == "single" else args.sp
                mp.spawn(_worker, args=(world, bench.free_port(), method, kv, args, ref_dir, results), nprocs=world)
                rows += list(results)
    if args.profile:
        table = floor_table(rows)
        with open(os.path.join(args.out, "profile_floor.md"), "w") as f:
            f.write(table + "\n")
        print(table)
        return
    for r in rows:
        print(f"{r['method']:>6} kv {r['kv_heads']} len {r['length']:>6}: {r['step_s']:.3f} s, "
              f"peak {r['peak_mb_ranks']} MB (step {r['step_mb']:.0f}), sent {r['sent_mb']:.2f} MB, "
              f"grad rel {r['grad_rel']:.1e} (worst tensor {r['grad_rel_tensor']:.1e}, plain SUM x{r['sum_x']:.2f}), "
              f"loss {r['loss']:.5f}; {r['ops']}")  # fmt: skip
    meta = {"model": bench.MODEL_META,
            "dtype": "float32", "attn": "sdpa", "cpus": os.cpu_count(), "args": vars(args)}  # fmt: skip
    bench.write_table(args.out, "alst", rows, meta)
    table = markdown(rows)
    with open(os.path.join(args.out, "alst.md"), "w") as f:
        f.write(table + "\n")
    plot(rows, args.out)
    print(table)


if __name__ == "__main__":
    main()
