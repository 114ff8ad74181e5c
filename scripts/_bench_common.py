"""Pieces shared by the benchmark scripts: per-process peak memory on Linux, free ports, glibc settings."""

from __future__ import annotations

import os
import socket
from typing import NoReturn

import torch

# The benchmarks' model: a random-init Llama small enough for a 2-core CPU, long sequences dominate its step.
HIDDEN, HEADS, LAYERS, VOCAB, INTERMEDIATE = 256, 8, 4, 1024, 688
MODEL_META = dict(hidden=HIDDEN, heads=HEADS, layers=LAYERS, vocab=VOCAB, intermediate=INTERMEDIATE)  # for the JSON

# glibc returns freed memory to the OS (large blocks unmapped, the heap trimmed), so VmHWM measures what a step
# really needs instead of what the allocator kept from earlier steps. Inherited by spawned workers.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def set_malloc_env() -> None:
    """Call in the parent before spawning workers (glibc reads these at process start)."""
    os.environ.update(MALLOC_ENV)


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def peak_mb() -> float:
    """This process's peak resident memory (VmHWM) since the last ``reset_peak``, in MiB."""
    return _status_mb("VmHWM")


def rss_mb() -> float:
    """This process's current resident memory (VmRSS), in MiB."""
    return _status_mb("VmRSS")


def reset_peak() -> None:
    """Reset VmHWM to the current resident size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available_mb() -> float:
    """MemAvailable of the machine, in MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def machine() -> dict:
    """What a measurement ran on: the CPU model and core count, torch's version and CPU capability (memory figures
    moved between two hosts once: ``docs/benchmarks/dsa_memory``), for every table's metadata."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__, "cpu_capability": capability}


def write_table(out_dir: str, stem: str, rows: list[dict], meta: dict) -> None:
    """``stem.csv`` (the rows) and ``stem.json`` (``meta``, the ``machine()``, and the rows) in ``out_dir``."""
    import csv
    import json

    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({**meta, "machine": machine(), "rows": rows}, f, indent=1)
    if not rows:
        return
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(os.path.join(out_dir, f"{stem}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def pyplot():
    """matplotlib's pyplot with a file backend, or None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install -e '.[bench]')")
        return None
    return plt


def bench_llama(kv_heads: int, attn: str = "sdpa", device: str = "cpu"):
    """The benchmarks' Llama (seed 0, fp32): ``LAYERS`` layers, hidden ``HIDDEN``, ``HEADS`` heads, ``kv_heads``
    kv heads, intermediate ``INTERMEDIATE``, vocab ``VOCAB``, no cache."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=kv_heads, max_position_embeddings=65536, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().to(device)


def packed_row(length: int, doc_size: int = 0) -> dict[str, torch.Tensor]:
    """One row of ``length`` random tokens (seeded by ``length``) packed as documents of ``doc_size`` tokens (0: one
    document), ``position_ids`` restarting at each; labels = tokens, each document's first token unlabelled."""
    position_ids = torch.arange(length) % (doc_size or length)
    input_ids = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(length))
    labels = input_ids.masked_fill(position_ids == 0, -100)
    return {"input_ids": input_ids[None], "position_ids": position_ids[None], "labels": labels[None]}


def end_spawned_worker() -> NoReturn:
    """The last call of a spawned benchmark worker: a barrier, the process groups destroyed, the exit hooks run,
    then exit code 0 (``hf_sp_trainer``'s own worker teardown). A normal interpreter exit would run the C++ static
    destructors, where a finished gloo process now and then aborts (``terminate called without an active
    exception``) and ``mp.spawn`` fails the whole benchmark. Write the worker's results before calling it."""
    from hf_sp_trainer.topology.teardown import end_process_groups, exit_finished_worker

    end_process_groups()
    exit_finished_worker()
