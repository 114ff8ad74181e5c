"""What ``sp_size="auto"`` chooses for three real model shapes at three lengths, beside ``hf-sp-plan``'s table.

    python scripts/plan_auto_sp.py [--gpus 8] [--gpu-memory-gib 80] [--lengths 32768 131072 524288]

The configs are built from dicts (no download): Llama-3.1-8B (full fine-tuning, ZeRO-3), a Qwen3-32B shape and
Llama-3.1-70B (both LoRA r16, ZeRO-3), each with activation checkpointing, the fused loss and the tiled MLP, bf16 on
CUDA. For each: the sp ``planner.auto.choose_sp`` picks at every length (or its refusal), then ``hf-sp-plan``'s
section (b) for the same setting (its ``--table-zero 3`` rows). Predictions of the analytical memory model
(``hf_sp_trainer/planner/``), not measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

import transformers

from hf_sp_trainer.cli import plan as plan_cli
from hf_sp_trainer.planner import GIB, Setting
from hf_sp_trainer.planner.auto import choose_sp, model_shape

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip
QWEN3_32B = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)  # fmt: skip
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip
# name -> (config, LoRA): every case with ZeRO-3, checkpointing, fused loss, tiled MLP, bf16
CASES = {
    "Llama-3.1-8B": (transformers.LlamaConfig(**LLAMA_8B), False),
    "Qwen3-32B": (transformers.Qwen3Config(**QWEN3_32B), True),
    "Llama-3.1-70B": (transformers.LlamaConfig(**LLAMA_70B), True),
}


def auto_rows(gpus: int, memory_gib: float, lengths: list[int]) -> list[dict]:
    rows = []
    for name, (config, lora) in CASES.items():
        shape = model_shape(config, name)
        setting = Setting(gpus=gpus, sp=1, zero=3, lora=lora, tiled_mlp=True, fused_loss=True)
        for length in lengths:
            try:
                plan = choose_sp(shape, length, memory_gib * GIB, gpus, setting)
                row = {"sp": plan.sp, "split": f"{plan.ulysses}x{plan.ring}", "peak_gib": round(plan.peak / GIB, 2)}
            except ValueError as exc:
                row = {"sp": None, "refusal": str(exc)}
            rows.append({"model": name, "training": "LoRA r16" if lora else "full", "length": length, **row})
    return rows


def plan_table(name: str, gpus: int, memory_gib: float) -> str:
    """``hf-sp-plan``'s section (b) for ``CASES[name]`` (its config written to a temporary file)."""
    config, lora = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.json")
        config.to_json_file(path)
        argv = ["--model", path, "--gpus", str(gpus), "--gpu-memory-gib", str(memory_gib), "--zero", "3",
                "--table-zero", "3", "--tiled-mlp", "--fused-loss", *(["--lora"] if lora else [])]  # fmt: skip
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            plan_cli.main(argv)
    text = out.getvalue()
    return text[text.index("(b)") : text.index("\nRows add")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 524288])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = auto_rows(args.gpus, args.gpu_memory_gib, args.lengths)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"sp_size='auto' on {args.gpus} x {args.gpu_memory_gib:g} GiB (ZeRO-3, checkpointing, fused loss, tiled MLP, "
          "bf16; predictions)")  # fmt: skip
    print(f"  {'model':<15}{'training':<10}{'length':>8}  {'sp':>3}  {'u x r':>5}  {'peak GiB':>9}")
    for r in rows:
        sp, split, peak = (r["sp"], r["split"], f"{r['peak_gib']:.2f}") if r["sp"] else ("—", "—", "does not fit")
        print(f"  {r['model']:<15}{r['training']:<10}{r['length'] // 1024:>7}K  {sp:>3}  {split:>5}  {peak:>9}")
    for r in rows:
        if r["sp"] is None:
            print(f"\n{r['model']} at {r['length'] // 1024}K: {r['refusal']}")
    for name in CASES:
        print(f"\nhf-sp-plan, {name} ({'LoRA r16' if CASES[name][1] else 'full fine-tuning'}):")
        print(plan_table(name, args.gpus, args.gpu_memory_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
