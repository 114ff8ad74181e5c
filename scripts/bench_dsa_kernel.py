"""DSA's selected-keys attention under SP: the gathered (sparse) kernel against the dense masked one.

``attention.dsa.selected_attention`` attends each query to the top-k keys its indexer picked. Its dense kernel
scores every key and masks the unselected (``O(s^2)`` work); its gathered kernel (``attention/gathered_keys.py``,
taken where the sequence holds ``GATHER_ABOVE`` times the top-k) gathers each query tile's picks (``O(s k)``). This
script times one forward and backward of each on the same inputs (one Ulysses rank's heads of an MLA layer: q / k
head dim 192, v 128, one document, picks drawn from each query's causal prefix) over the length at a fixed top-k,
checks they agree, and records the peak resident memory each adds (VmHWM, fp32, CPU). Both tile their queries
(``SCORE_BYTES``), each tile recomputed in the backward.

    python scripts/bench_dsa_kernel.py --out docs/benchmarks/dsa_kernel
    python scripts/bench_dsa_kernel.py --smoke --out /tmp/dsa_kernel      # small (tests)

Writes ``dsa_kernel.{csv,json}`` (and ``dsa_kernel.png`` with matplotlib) to ``--out``; prints markdown.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bench  # noqa: E402

HEADS, QK_DIM, V_DIM = 4, 192, 128  # DeepSeek-V3.2's MLA head dims; 128 heads over Ulysses 32 (or 4 of a tiny one)
KERNELS = ("dense", "gathered")


def inputs(seq: int, topk: int, heads: int, device, dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[1, heads, seq, d]``, the picks ``[1, seq, topk]`` (each query itself and draws from its causal
    prefix: repeats and a short prefix's surplus are dropped by the kernels) and the bounds of one document."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, heads, seq, QK_DIM, generator=gen) for _ in range(2))
    v = torch.randn(1, heads, seq, V_DIM, generator=gen)
    prefix = torch.arange(1, seq + 1).view(1, seq, 1)
    picks = (torch.rand(1, seq, topk, generator=gen) * prefix).long()
    picks[..., 0] = torch.arange(seq)
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    return q, k, v, picks.to(device=device, dtype=torch.int32), torch.tensor([0, seq], device=device)


def cpu_measure(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float, float]:
    """``fn()``, the peak resident memory it added (MiB, VmHWM) and its seconds."""
    base = bench.rss_mb()
    bench.reset_peak()
    start = time.perf_counter()
    result = fn()
    return result, bench.peak_mb() - base, time.perf_counter() - start


def run_kernel(kernel: str, q, k, v, picks, bounds) -> torch.Tensor:
    """One forward + backward of ``selected_attention`` on ``kernel`` ("dense" / "gathered"); its output."""
    from hf_sp_trainer.attention import dsa, gathered_keys

    saved = gathered_keys.GATHER_ABOVE
    gathered_keys.GATHER_ABOVE = 0 if kernel == "gathered" else float("inf")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    try:
        out = dsa.selected_attention(*leaves, picks, bounds, QK_DIM**-0.5)
        out.float().sum().backward()
        return out.detach()
    finally:
        gathered_keys.GATHER_ABOVE = saved


def compare(seq: int, topk: int, heads: int, device, dtype, repeats: int, measure=cpu_measure) -> dict:
    """Both kernels on the same inputs, ``repeats`` times each: the fastest time, the largest peak (``measure``:
    ``(result, peak MiB, seconds)`` of a call), the speed-up and the kernels' largest difference."""
    data = inputs(seq, topk, heads, device, dtype)
    runs = {
        kernel: [measure(lambda kernel=kernel: run_kernel(kernel, *data)) for _ in range(repeats)] for kernel in KERNELS
    }
    dense, gathered = (min(runs[kernel], key=lambda r: r[2]) for kernel in KERNELS)
    error = float((gathered[0] - dense[0]).abs().max() / dense[0].abs().max())
    peaks = {kernel: round(max(r[1] for r in runs[kernel]), 1) for kernel in KERNELS}
    return dict(seq=seq, topk=topk, heads=heads, dense_s=round(dense[2], 4), gathered_s=round(gathered[2], 4),
                speedup=round(dense[2] / gathered[2], 2), dense_peak_mib=peaks["dense"],
                gathered_peak_mib=peaks["gathered"], max_rel_diff=f"{error:.1e}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="two short lengths, one repeat")
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="the fastest of these is reported")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lengths = [256, 512] if args.smoke else [2048, 4096, 8192, 16384]
    topk, repeats = (32, 1) if args.smoke else (args.topk, args.repeats)
    compare(128, 16, HEADS, "cpu", torch.float32, 1)  # warm-up, not recorded
    rows = []
    for seq in lengths:
        rows.append(compare(seq, topk, HEADS, "cpu", torch.float32, repeats))
        print(rows[-1], flush=True)
    meta = dict(heads=HEADS, qk_dim=QK_DIM, v_dim=V_DIM, dtype="float32", threads=torch.get_num_threads())
    bench.write_table(args.out, "dsa_kernel", rows, meta)
    print("| length | top-k | dense fwd+bwd | gathered | speed-up | dense peak | gathered peak | max rel diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['seq']} | {r['topk']} | {r['dense_s']} s | {r['gathered_s']} s | {r['speedup']}x | "
              f"{r['dense_peak_mib']} MiB | {r['gathered_peak_mib']} MiB | {r['max_rel_diff']} |")  # fmt: skip
    plt = bench.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for kernel in ("dense", "gathered"):
            ax.plot([r["seq"] for r in rows], [r[f"{kernel}_s"] for r in rows], marker="o", label=kernel)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="fwd + bwd seconds (CPU)")
        ax.set_title(f"DSA selected-keys attention, top-{topk}, {HEADS} heads")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "dsa_kernel.png"), dpi=120)
    for r in rows:
        if float(r["max_rel_diff"]) > 1e-5:
            raise SystemExit(f"the kernels disagree at {r['seq']} tokens: {r['max_rel_diff']}")


if __name__ == "__main__":
    main()
