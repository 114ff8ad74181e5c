"""Benchmark: hybrid (Gated DeltaNet) layers under SP, ours vs the head-wise all-to-all; SP overhead on a tiny Qwen3.5.

    python scripts/bench_hybrid.py --sp 2 4 --lengths 8192 16384 32768 --repeats 2
    python scripts/bench_hybrid.py --smoke  # tiny sizes, for tests/test_scripts.py

1. One GDN layer's mixer (conv + chunked delta rule; ``_hybrid_layer.py``), ``--v-heads``/``--k-heads``/``--dim``
   (default Hv 8, Hk 4, K = V 64, W 4, fp32, one row), on ``sp`` spawned CPU processes (gloo, Ulysses layout), per
   length: (a) bytes sent + received per rank per forward + backward, from the shapes (``ours_bytes``,
   ``headwise_bytes``) and counted from the tensors handed to the collectives (``CommLog``); (b) the wall time of
   forward + backward (median of ``--repeats`` after a warm-up, barriers around); (c) the max relative difference
   between the two outputs and input gradients (a benchmark of a wrong implementation is worthless).
2. The same bytes, analytically, for the real Qwen3.5 / Qwen3-Next GDN shape (Hv 32, Hk 16, K = V 128, bf16
   activations, fp32 summaries and decay) at 8K-256K tokens and sp 2-8.
3. A tiny random-init Qwen3.5 (``tiny_qwen35``: 4 layers, 3 GDN + 1 attention): ``apply_sequence_parallel(model,
   sp)`` forward + backward on one packed row (``--model-docs`` documents) vs the same model in one process on the
   documents as rows of a batch (equal sizes: no padding); each process 1 thread. ``overhead`` = sp x SP step /
   single step: the work SP adds (1.0 = perfect scaling, if each rank had its own core).

On a shared 2-core machine the times are noisy: compare the ratios within one run. Writes ``hybrid_layer.*``,
``hybrid_bytes.*``, ``hybrid_model.*`` (CSV + JSON) and ``hybrid.png`` to ``--out``; prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import _bench_common as bench
import _hybrid_layer as hl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KB, MB = 2**10, 2**20


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- 1. one layer -------------------------------------------------------------------------------------------------
def _layer_case(m: hl.GDNShape, length: int, doc: int, repeats: int) -> dict:
    from hf_sp_trainer.documents import document_bounds
    from hf_sp_trainer.mixers.runs import shard_runs
    from hf_sp_trainer.sharding import SequenceSharding
    from hf_sp_trainer.topology import release_groups, sp_topology

    sp = dist.get_world_size()
    topo = sp_topology(sp, 1)
    sharding = SequenceSharding(sp, 1)
    docs = [(s, min(s + doc, length)) for s in range(0, length, doc)]
    runs = shard_runs(document_bounds([docs], length), 1, sharding, topo.sp_rank)
    index = sharding.positions(length, topo.sp_rank)
    gen = torch.Generator().manual_seed(length)
    full = dict(
        qkv=torch.randn(1, length, m.channels, generator=gen),
        beta=torch.rand(1, length, m.v_heads, generator=gen),
        g=-0.1 * torch.rand(1, length, m.v_heads, generator=gen),
    )
    weight = torch.randn(m.channels, m.width, generator=gen) / m.width
    probe = torch.randn(1, length, m.v_heads, m.v_dim, generator=gen)[:, index]
    fns = {
        "ours": lambda x, w: hl.ours(*x, w, m, runs, topo.sp_group),
        "headwise": lambda x, w: hl.headwise(*x, w, m, docs, topo.sp_group),
    }
    result, grads = {"sp": sp, "length": length, "doc_size": doc, "docs": len(docs)}, {}
    for name, fn in fns.items():
        inputs = [full[k][:, index].clone().requires_grad_() for k in ("qkv", "beta", "g")]
        w = weight.clone().requires_grad_()

        def step(inputs=inputs, w=w, fn=fn):
            for t in (*inputs, w):
                t.grad = None
            out = fn(inputs, w)
            (out * probe).sum().backward()
            return out

        with hl.CommLog() as log:
            out = step()
        dist.all_reduce(w.grad)  # the conv weight's gradient is partial per rank in both
        grads[name] = [out.detach(), *(t.grad for t in inputs), w.grad]
        result[f"{name}_s"] = _timed(step, repeats)
        result[f"{name}_mb"] = log.total / MB
        result[f"{name}_calls"] = " ".join(f"{k}x{v}" for k, v in sorted(log.calls.items()))
    diffs = [_rel(a, b) for a, b in zip(grads["ours"], grads["headwise"], strict=True)]
    worst = torch.tensor([diffs[0], max(diffs[1:])], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    theory_ours, theory_hw = hl.ours_bytes(m, sp), hl.headwise_bytes(m, sp, length)
    result.update(
        ours_theory_mb=sum(theory_ours.values()) / MB, headwise_theory_mb=sum(theory_hw.values()) / MB,
        out_rel=float(worst[0]), grad_rel=float(worst[1]), time_ratio=result["ours_s"] / result["headwise_s"],
    )  # fmt: skip
    release_groups()
    return result


def _layer_worker(rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    m = hl.GDNShape(args.v_heads, args.k_heads, args.dim, args.dim)
    for length in args.lengths:
        row = _layer_case(m, length, args.doc_size or length, args.repeats)
        mb = torch.tensor([row["ours_mb"], row["headwise_mb"]], dtype=torch.float64)
        dist.all_reduce(mb, op=dist.ReduceOp.MAX)  # the busiest rank
        row["ours_mb"], row["headwise_mb"] = mb.tolist()
        if rank == 0:
            results.append(row)
            print(f"layer sp {world} len {length}: ours {row['ours_s']:.2f} s {row['ours_mb']:.3f} MB "
                  f"(theory {row['ours_theory_mb']:.3f}), headwise {row['headwise_s']:.2f} s {row['headwise_mb']:.2f} "
                  f"MB (theory {row['headwise_theory_mb']:.2f}); max rel diff out {row['out_rel']:.1e} grads "
                  f"{row['grad_rel']:.1e}", flush=True)  # fmt: skip
    bench.end_spawned_worker()


# -- 2. the real GDN shape, analytically ----------------------------------------------------------------------------
def real_bytes(lengths: list[int], sps: list[int]) -> list[dict]:
    rows = []
    for sp in sps:
        for length in lengths:
            o1, o2 = hl.ours_bytes(hl.QWEN35, sp, act=2), hl.ours_bytes(hl.QWEN35, sp, max_runs=2, act=2)
            hw, hwz = (hl.headwise_bytes(hl.QWEN35, sp, length, act=2, z=z) for z in (False, True))
            rows.append({
                "sp": sp, "length": length, "ours_mb": sum(o1.values()) / MB, "ours_ring_mb": sum(o2.values()) / MB,
                "ours_summary_mb": o1["summary"] / MB, "ours_halo_kb": o1["halo"] / KB,
                "headwise_mb": sum(hw.values()) / MB, "headwise_z_mb": sum(hwz.values()) / MB,
                "headwise_over_ours": sum(hw.values()) / sum(o1.values()),
            })  # fmt: skip
    return rows


# -- 3. the tiny model --------------------------------------------------------------------------------------------
def tiny_qwen35():
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=bench.VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, layer_types=["linear_attention"] * 3 + ["full_attention"], use_cache=False,
        max_position_embeddings=65536,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).float()


def _model_worker(rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from hf_sp_trainer import apply_sequence_parallel

    model, length = tiny_qwen35(), args.model_length
    batch = bench.packed_row(length, length // args.model_docs)
    labels = int((batch["labels"] != -100).sum())
    sp = apply_sequence_parallel(model, world, attn_implementation="sdpa")
    shard = sp.shard_batch(batch)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**shard, num_items_in_batch=torch.tensor(labels)).loss
        loss.backward()
        return loss.detach()

    loss = step().clone()
    dist.all_reduce(loss)
    seconds = _timed(step, args.repeats)
    if rank == 0:
        results.append({"sp": world, "loss": float(loss), "sp_s": seconds})
    sp.remove()
    bench.end_spawned_worker()


def single_model(args) -> dict:
    torch.set_num_threads(1)
    model, length, docs = tiny_qwen35(), args.model_length, args.model_docs
    row = bench.packed_row(length, length // docs)
    batch = {k: v.view(docs, -1) for k, v in row.items() if k != "position_ids"}  # the documents as rows
    labels = int((batch["labels"] != -100).sum())

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**batch, num_items_in_batch=torch.tensor(labels)).loss
        loss.backward()
        return loss.detach()

    loss = float(step())
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"loss": loss, "single_s": statistics.median(times)}


# -- output ---------------------------------------------------------------------------------------------------------
def markdown(layer: list[dict], real: list[dict], model: list[dict], m: hl.GDNShape) -> str:
    lines = [
        f"One GDN layer (Hv {m.v_heads}, Hk {m.k_heads}, K = V {m.k_dim}, W {m.width}, fp32), per rank per forward + "
        "backward; MB sent + received (counted / from the shapes); time ratio = ours / head-wise, same run:",
        "",
        "| sp | length | ours MB | theory | head-wise MB | theory | ours s | head-wise s | ours/hw | max rel diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in layer:
        lines.append(
            f"| {r['sp']} | {r['length']} | {r['ours_mb']:.3f} | {r['ours_theory_mb']:.3f} | {r['headwise_mb']:.2f} | "
            f"{r['headwise_theory_mb']:.2f} | {r['ours_s']:.2f} | {r['headwise_s']:.2f} | {r['time_ratio']:.2f} | "
            f"{max(r['out_rel'], r['grad_rel']):.1e} |"
        )
    lines += [
        "",
        "Qwen3.5 / Qwen3-Next GDN (Hv 32, Hk 16, K = V 128, bf16), analytic, MB per rank per layer per forward + "
        "backward:",
        "",
        "| sp | length | ours (Ulysses) | ours (ring, 2 runs) | head-wise | head-wise + z | head-wise / ours |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in real:
        lines.append(
            f"| {r['sp']} | {r['length']} | {r['ours_mb']:.1f} | {r['ours_ring_mb']:.1f} | {r['headwise_mb']:.1f} | "
            f"{r['headwise_z_mb']:.1f} | {r['headwise_over_ours']:.2f} |"
        )
    if model:
        lines += ["", "| sp | length | docs | single s | SP s | overhead (sp x SP / single) | loss SP / single |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in model:
            lines.append(
                f"| {r['sp']} | {r['length']} | {r['docs']} | {r['single_s']:.2f} | {r['sp_s']:.2f} | "
                f"{r['overhead']:.2f} | {r['loss_sp']:.5f} / {r['loss_single']:.5f} |"
            )
    return "\n".join(lines)


def plot(layer: list[dict], real: list[dict], out: str) -> None:
    plt = bench.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for sp in sorted({r["sp"] for r in real}):
        rs = [r for r in real if r["sp"] == sp]
        axes[0].plot([r["length"] for r in rs], [r["headwise_mb"] for r in rs], "o-", label=f"head-wise sp{sp}")
        axes[0].plot([r["length"] for r in rs], [r["ours_mb"] for r in rs], "s--", label=f"ours sp{sp}")
    axes[0].set(xscale="log", yscale="log", xlabel="tokens", ylabel="MB per rank per layer (fwd + bwd)")
    axes[0].set_title("Qwen3.5 GDN layer, bytes (analytic)", fontsize=9)
    for sp in sorted({r["sp"] for r in layer}):
        rs = [r for r in layer if r["sp"] == sp]
        axes[1].plot([r["length"] for r in rs], [r["headwise_mb"] for r in rs], "o-", label=f"head-wise sp{sp}")
        axes[1].plot([r["length"] for r in rs], [r["ours_mb"] for r in rs], "s--", label=f"ours sp{sp}")
        axes[2].plot([r["length"] for r in rs], [r["time_ratio"] for r in rs], "o-", label=f"sp{sp}")
    axes[1].set(xscale="log", yscale="log", xlabel="tokens", ylabel="MB counted")
    axes[1].set_title("benchmark layer, bytes counted in the run", fontsize=9)
    axes[2].axhline(1.0, color="k", lw=0.5)
    axes[2].set(xscale="log", xlabel="tokens", ylabel="ours / head-wise")
    axes[2].set_title("layer fwd + bwd time ratio (same run)", fontsize=9)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "hybrid.png"), dpi=120)


def _spawn(worker, sp: int, args) -> list[dict]:
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(worker, args=(sp, bench.free_port(), args, results), nprocs=sp)
        return list(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--doc-size", type=int, default=0, help="packed documents of this size (0: one document)")
    parser.add_argument("--v-heads", type=int, default=8)
    parser.add_argument("--k-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-sp", type=int, nargs="*", default=[2])
    parser.add_argument("--model-length", type=int, default=4096)
    parser.add_argument("--model-docs", type=int, default=4)
    parser.add_argument("--real-lengths", type=int, nargs="+", default=[8192, 32768, 131072, 262144])
    parser.add_argument("--real-sp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--bytes-only", action="store_true", help="only the analytic Qwen3.5 table (hybrid_bytes)")
    parser.add_argument("--out", default="docs/benchmarks/hybrid")
    args = parser.parse_args()
    if args.smoke:
        args.sp, args.lengths, args.v_heads, args.k_heads, args.dim, args.repeats = [2], [256], 4, 2, 16, 1
        args.model_length, args.model_docs, args.doc_size = 256, 2, 96
    os.makedirs(args.out, exist_ok=True)
    m = hl.GDNShape(args.v_heads, args.k_heads, args.dim, args.dim)
    real = real_bytes(args.real_lengths, args.real_sp)
    if args.bytes_only:
        bench.write_table(args.out, "hybrid_bytes", real, {"layer": vars(hl.QWEN35), "activations": "bf16"})
        print(markdown([], real, [], m))
        return
    layer = [row for sp in args.sp for row in _spawn(_layer_worker, sp, args)]
    model = []
    if args.model_sp:
        single = single_model(args)
        for sp in args.model_sp:
            (r,) = _spawn(_model_worker, sp, args)
            model.append({"sp": sp, "length": args.model_length, "docs": args.model_docs, "sp_s": r["sp_s"],
                          "single_s": single["single_s"], "overhead": sp * r["sp_s"] / single["single_s"],
                          "loss_sp": r["loss"], "loss_single": single["loss"]})  # fmt: skip
    meta = {"layer": vars(m), "dtype": "float32", "cpus": os.cpu_count(), "args": vars(args)}
    bench.write_table(args.out, "hybrid_layer", layer, meta)
    bench.write_table(args.out, "hybrid_bytes", real, {"layer": vars(hl.QWEN35), "activations": "bf16"})
    bench.write_table(args.out, "hybrid_model", model, meta)
    plot(layer, real, args.out)
    print(markdown(layer, real, model, m))
    bad = [r for r in layer if max(r["out_rel"], r["grad_rel"]) > 1e-4]
    if bad:
        raise SystemExit(f"ours and head-wise disagree: {bad}")


if __name__ == "__main__":
    main()
