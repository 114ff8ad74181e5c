"""Benchmark: the SP delta rule (Gated DeltaNet) with its kernel called once per document segment vs once per list
of segments (``cu_seqlens``, FLA's kernels), on one row packed from documents of one length (issue 34, item 3).

    python scripts/bench_varlen.py                        # CUDA with FLA: 32K tokens, Qwen3.5's GDN shape, bf16
    TRITON_INTERPRET=1 python scripts/bench_varlen.py     # CPU, FLA's kernels under Triton's interpreter, tiny sizes
    python scripts/bench_varlen.py --smoke                # CPU without FLA: the loop only (tests/test_scripts.py)

One layer's ``sp_chunk_gated_delta_rule`` (``hf_sp_trainer.mixers``) at sp 1, documents kept apart, forward +
backward: the median wall time of ``--repeats`` after a warm-up, the kernel calls of one forward, and the max relative
difference of the varlen output and input gradients from the loop's (a benchmark of a wrong path is worthless). The
kernel is the one transformers' Qwen3.5 dispatches to: FLA's where it runs (CUDA, or the CPU under
``TRITON_INTERPRET=1``), else its torch path, which refuses ``cu_seqlens`` (then only the loop is timed). Under the
interpreter every kernel launch runs its program grid in numpy: the times show what launches cost there, not GPU
speed. Writes ``varlen.csv`` / ``varlen.json`` / ``varlen.png`` to ``--out`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # hf_sp_trainer from a checkout
if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's shims, before FLA is imported (the GPU-kernel tier's)
    from tests.interpreter import shims

    shims.install()

QWEN35_GDN = dict(v_heads=32, k_heads=16, k_dim=128, v_dim=128)  # Qwen3.5 / Qwen3-Next linear attention
TINY = dict(v_heads=2, k_heads=1, k_dim=16, v_dim=16)


def delta_rule_kernel():
    """transformers' Qwen3.5 delta-rule function as its layers call it (the hub wrapper: FLA's kernel if installed)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from hf_sp_trainer import patches

    return patches.original(modeling_qwen3_5, "torch_chunk_gated_delta_rule")


def layer_inputs(tokens: int, shape: dict, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Random q, k, v, g (weak decay), beta of one row on ``device``, in ``dtype`` (g in fp32, as the layer has it)."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, tokens, shape["k_heads"], shape["k_dim"], generator=gen) for _ in range(2))
    v = torch.randn(1, tokens, shape["v_heads"], shape["v_dim"], generator=gen)
    g = -0.05 * torch.rand(1, tokens, shape["v_heads"], generator=gen)
    beta = torch.rand(1, tokens, shape["v_heads"], generator=gen)
    return [t.to(device, torch.float32 if t is g else dtype) for t in (q, k, v, g, beta)]


def one_pass(kernel, inputs: list[torch.Tensor], doc_len: int, varlen: bool) -> tuple[float, int, list[torch.Tensor]]:
    """Forward + backward of the SP delta rule on ``inputs`` cut into documents of ``doc_len``: (seconds, kernel calls
    of the forward, [output, input gradients])."""
    from hf_sp_trainer.mixers.gated_deltanet import sp_chunk_gated_delta_rule
    from hf_sp_trainer.mixers.runs import shard_runs
    from hf_sp_trainer.sharding import SequenceSharding

    tokens = inputs[0].shape[1]
    bounds = torch.tensor([*range(0, tokens, doc_len), tokens])
    runs = shard_runs(bounds, 1, SequenceSharding(1), 0)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    sync = torch.cuda.synchronize if inputs[0].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    out, _ = sp_chunk_gated_delta_rule(
        counted, *leaves, runs, None, varlen=varlen, use_qk_l2norm_in_kernel=True
    )  # fmt: skip
    forward_calls = len(calls)
    out.float().square().mean().backward()
    sync()
    return time.perf_counter() - start, forward_calls, [out.detach(), *(t.grad for t in leaves)]


def max_rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
        for a, b in zip(got, ref, strict=True)
    )


def varlen_timings(device: torch.device, dtype: torch.dtype, tokens: int, doc_lens: list[int], shape: dict,
                   repeats: int) -> dict[str, Any]:  # fmt: skip
    """Per document length: the loop's and (where the kernel takes ``cu_seqlens``) the varlen path's time, calls and
    difference."""
    from hf_sp_trainer.mixers.check_parts import dispatch_device
    from hf_sp_trainer.mixers.varlen_checks import varlen_capable

    kernel = delta_rule_kernel()
    varlen_ok = varlen_capable(kernel, device)
    target = dispatch_device(device)
    inputs = layer_inputs(tokens, shape, device, dtype)
    rows = []
    for doc_len in doc_lens:
        results = {}
        for mode in ("loop", "varlen") if varlen_ok else ("loop",):
            one_pass(kernel, inputs, doc_len, mode == "varlen")  # warm-up (compiles on CUDA)
            timed = [one_pass(kernel, inputs, doc_len, mode == "varlen") for _ in range(repeats)]
            results[mode] = timed[-1][2]
            row = {"tokens": tokens, "doc_len": doc_len, "documents": -(-tokens // doc_len), "mode": mode,
                   "kernel_calls": timed[-1][1], "seconds": statistics.median(t for t, _, _ in timed)}  # fmt: skip
            if mode == "varlen":
                row["max_rel_vs_loop"] = max_rel(results["varlen"], results["loop"])
                row["loop_over_varlen"] = rows[-1]["seconds"] / row["seconds"]
            rows.append(row)
            print(row, flush=True)
    return {
        "device": str(device), "dtype": str(dtype), "shape": shape, "repeats": repeats,
        "kernel": "FLA (cu_seqlens)" if varlen_ok else "transformers' torch path (no cu_seqlens: loop only)",
        "interpreted": target == "cpu", "rows": rows,
    }  # fmt: skip


def plot(out_dir: str, result: dict) -> None:
    import _bench_common as bench

    plt = bench.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode in ("loop", "varlen"):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        if rows:
            ax.plot([r["documents"] for r in rows], [r["seconds"] * 1e3 for r in rows], "o-", label=mode)
    ax.set_xscale("log")
    ax.set_xlabel(f"documents in the {result['rows'][0]['tokens']}-token row")
    ax.set_ylabel("forward + backward (ms)")
    where = "Triton interpreter on CPU" if result["interpreted"] else result["device"]
    ax.set_title(f"GDN layer, sp 1: kernel per segment vs per list ({where})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "varlen.png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--doc-lens", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--out", default="docs/benchmarks/varlen")
    opts = parser.parse_args()
    import _bench_common as bench

    cuda = torch.cuda.is_available() and not opts.smoke
    device = torch.device("cuda" if cuda else "cpu")
    shape, dtype = (QWEN35_GDN, torch.bfloat16) if cuda else (TINY, torch.float32)
    tokens = opts.tokens or (32768 if cuda else 64 if opts.smoke else 512)
    doc_lens = opts.doc_lens or ([32768, 4096, 512, 64] if cuda else [64, 8] if opts.smoke else [512, 128, 32, 8])
    result = varlen_timings(device, dtype, tokens, doc_lens, shape, 1 if opts.smoke else opts.repeats)
    os.makedirs(opts.out, exist_ok=True)
    bench.write_table(opts.out, "varlen", result["rows"], {k: v for k, v in result.items() if k != "rows"})
    plot(opts.out, result)
    print(f"\n{result['kernel']} on {result['device']}" + (" (Triton interpreter)" if result["interpreted"] else ""))
    print("| documents | mode | kernel calls | ms | loop / varlen | max rel vs loop |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        ratio, diff = r.get("loop_over_varlen"), r.get("max_rel_vs_loop")
        extra = "| |" if ratio is None else f"| {ratio:.2f} | {diff:.1e} |"
        print(f"| {r['documents']} | {r['mode']} | {r['kernel_calls']} | {r['seconds'] * 1e3:.1f} {extra}")


if __name__ == "__main__":
    main()
