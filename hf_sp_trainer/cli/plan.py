"""``hf-sp-plan``: predicted per-GPU memory of SP training, and the longest trainable length per setting.

    hf-sp-plan --model meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory-gib 80 --lora --fused-loss --tiled-mlp
    hf-sp-plan --model path/to/config.json --gpus 8 --gpu-memory-gib 139 --zero 3 --length 262144 --json

Prints (a) the predicted peak of one setting at ``--length`` (default: the longest length that fits) with its
breakdown, and (b) the longest trainable length for every sp dividing ``--gpus`` (Ulysses x ring split as
``SPTrainer`` chooses it), ZeRO stage and memory-stack combination. Predictions of an analytical model
(``hf_sp_trainer/planner/``), checked against CPU measurements of ``scripts/bench_memory.py``; not GPU measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from .. import planner
from ..planner import GIB, MIB, ModelShape, Setting
from ..planner.auto import model_shape, vision_params  # noqa: F401 (vision_params: moved there, kept importable)
from ..planner.sparse import check_setting


def load_shape(model: str) -> ModelShape:
    """A local ``config.json`` (or a directory holding one), or a hub id (needs the network or the HF cache)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    name = model
    if os.path.isdir(model):
        name = os.path.basename(os.path.abspath(model))
    elif os.path.isfile(model):  # path/NAME/config.json or path/NAME.json
        stem = os.path.splitext(os.path.basename(model))[0]
        name = os.path.basename(os.path.dirname(os.path.abspath(model))) if stem == "config" else stem
    return model_shape(config, name=name or model)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="hf-sp-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="config.json path, model directory or hub id")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the run (world size = dp x sp)")
    p.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU, GiB")
    p.add_argument("--sp", type=int, default=None, help="ranks per sequence (default: --gpus)")
    p.add_argument("--ring", type=int, default=None, help="ring size (default: as SPTrainer splits sp)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (FSDP2 = 3)")
    p.add_argument("--table-zero", type=int, nargs="+", default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stages in the table (default: 0 1 2 3)")  # fmt: skip
    p.add_argument("--lora", action="store_true", help="LoRA on all linear layers (frozen base weights)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--tiled-mlp", action="store_true")
    p.add_argument("--fused-loss", action="store_true")
    p.add_argument("--checkpointing", default="full", choices=["none", "full", "sequence_aware", "auto"],
                   help="auto: checkpoint_policy='auto' with the GPU's memory as its budget")  # fmt: skip
    p.add_argument("--offload", action="store_true", help="activation offloading of the checkpoints")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: predict a scripts/bench_memory.py run (RSS, memory per process)")  # fmt: skip
    p.add_argument("--image-share", type=float, default=0.0,
                   help="VLMs: fraction of the row's tokens that are image placeholders (default 0)")  # fmt: skip
    p.add_argument("--vision", default=None, choices=["trained", "frozen"],
                   help="VLMs: the tower trains or is frozen (default: frozen with --lora, else trained)")  # fmt: skip
    p.add_argument("--split-media", action="store_true",
                   help="VLMs: sp_split_media (each rank encodes 1/sp of the images)")  # fmt: skip
    p.add_argument("--reference-model", action="store_true",
                   help="GRPO / RLOO with beta > 0 (not LoRA): TRL's reference copy of the weights")  # fmt: skip
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.0,
                   help="GRPO / RLOO: a colocated vLLM engine's share of each GPU (its reservation)")  # fmt: skip
    p.add_argument("--vllm-sleep-mode", action="store_true", help="the colocated engine sleeps while training")
    p.add_argument("--length", type=int, default=None, help="tokens per sequence for (a) (default: the longest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p.parse_args(argv)


def _gib(x: float) -> str:
    return f"{x / GIB:9.2f} GiB"


def _tokens(n: int) -> str:
    if n <= 0:
        return "—"
    text = f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"
    return f"≥ {text}" if n >= planner.MAX_LENGTH else text


def _describe(s: Setting, ulysses: int, ring: int) -> str:
    parts = [f"sp {s.sp} (ulysses {ulysses} x ring {ring}), dp {s.gpus // s.sp}", f"ZeRO-{s.zero}",
             f"LoRA r{s.lora_r}" if s.lora else "full fine-tuning", f"checkpointing={s.checkpointing}"]  # fmt: skip
    parts += [name for name, on in (("tiled MLP", s.tiled_mlp), ("fused loss", s.fused_loss), ("offload", s.offload))
              if on]  # fmt: skip
    return ", ".join(parts + [s.dtype, s.device])


def _hybrid(m: ModelShape) -> str:
    parts = [f"{m.attention_layers} attention"]
    if m.gdn_layers:
        parts.append(f"{m.gdn_layers} Gated DeltaNet (Hk {m.linear_k_heads}, Hv {m.linear_v_heads}, K "
                     f"{m.linear_k_dim}, V {m.linear_v_dim}, conv {m.conv_width})")  # fmt: skip
    if m.conv_layers:
        parts.append(f"{m.conv_layers} short conv (width {m.conv_width})")
    return " + ".join(parts) + " layers"


def breakdown_lines(m: ModelShape, e: planner.Breakdown, budget: float, device: str = "cuda") -> list[str]:
    when = "start of backward" if e.peak_phase == "activations" else "end of backward / optimizer step"
    parts = [
        ("weights", e.weights, ""),
        ("optimizer states", e.optimizer_states, ""),
        ("gradients", e.gradients, ""),
        ("DDP gradient buckets", e.comm_buffers, ""),
        ("runtime / CUDA overhead", e.runtime, ""),
        (f"saved activations, {m.layers} layers", e.saved_activations, "checkpoints (+ saved attention), or all"),
        *(
            [("  of which the vision tower's", e.vision_activations, "the row's pixels (+ the tower's saved)")]
            if m.vision
            else []
        ),  # fmt: skip
        ("one layer's working set", e.layer_working_set, "recompute + backward, all-to-all / ring buffers"),
        ("logits / loss", e.loss, "logits (or one chunk), final norm, LM-head gradient"),
        ("optimizer-step temporaries", e.optimizer_step, ""),
        ("activation phase", e.activation_phase, "saved + max(loss, LM-head grad + one layer)"),
        ("gradient phase", e.gradient_phase, "max(gradients so far + first layer, gradients + optimizer step)"),
    ]
    if e.reference_weights:
        parts.append(("reference model (GRPO / RLOO)", e.reference_weights, "frozen weights, beta > 0"))
    if e.engine:
        parts.append(("colocated vLLM engine", e.engine, "its reservation (sleep mode: while it generates)"))
    if e.host_offload:
        parts.append(("offloaded checkpoints (host)", e.host_offload, "host memory per GPU, not in the peak"))
    unit = "GPU" if device == "cuda" else "process"
    lines = [
        f"(a) predicted per-{unit} peak at {e.length:,} tokens ({e.local_tokens:,} per rank): "
        f"{e.peak / GIB:.2f} GiB of {budget / GIB:g} GiB, at the {when}"
    ]
    lines += [f"    {name:<32}{_gib(value)}" + (f"   ({note})" if note else "") for name, value, note in parts]
    extra = (" + reference" if e.reference_weights else "") + (" + engine" if e.engine else "")
    lines.append(
        f"    peak = runtime + weights + optimizer states{extra} + buckets + max(activation phase, gradient phase)"
    )
    return lines


def table_lines(rows: list[dict]) -> list[str]:
    cols = list(rows[0]["longest"]) if rows else []
    width = max(len(r["stack"]) for r in rows) if rows else 10
    out = [f"  ZeRO  {'memory stack':<{width}}  " + "  ".join(f"{'sp ' + c:>13}" for c in cols)]
    for r in rows:
        cells = "  ".join(f"{_tokens(n):>13}" for n in r["longest"].values())
        out.append(f"  {r['zero']:>4}  {r['stack']:<{width}}  {cells}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shape = load_shape(args.model)
    except (OSError, ValueError) as exc:  # no such file, hub unreachable, not a dense decoder config
        print(f"hf-sp-plan: could not load a model config from {args.model!r}: {exc}", file=sys.stderr)
        return 2
    setting = Setting(
        gpus=args.gpus, sp=args.sp or args.gpus, ring=args.ring, zero=args.zero, lora=args.lora, lora_r=args.lora_r,
        tiled_mlp=args.tiled_mlp, fused_loss=args.fused_loss, offload=args.offload,
        checkpointing="full" if args.checkpointing == "auto" else args.checkpointing,
        dtype=args.dtype, device=args.device, image_share=args.image_share,
        vision_trained=None if args.vision is None else args.vision == "trained", split_media=args.split_media,
        reference_model=args.reference_model, engine_sleeps=args.vllm_sleep_mode,
        engine_bytes=args.vllm_gpu_memory_utilization * args.gpu_memory_gib * GIB,
    )  # fmt: skip
    try:
        setting.validate()
        ulysses, ring = planner.split_sp_size(setting.sp, shape.heads, setting.ring)
        check_setting(shape, setting, auto=args.checkpointing == "auto")
    except ValueError as exc:
        print(f"hf-sp-plan: {exc}", file=sys.stderr)
        return 2
    budget = args.gpu_memory_gib * GIB
    longest = planner.longest_length(shape, setting, budget)
    length = args.length or longest or planner.granularity(shape, setting)
    estimate = planner.estimate(shape, setting, length)
    table = planner.plan_table(shape, setting, budget, args.table_zero or [0, 1, 2, 3])
    auto = None
    if args.checkpointing == "auto":
        auto = planner.auto_kept_layers(shape, setting, length, budget)._asdict()
        auto["attention_layers"] = shape.attention_layers
    if args.json:
        constants = {k: getattr(planner, k) for k in dir(planner) if k.isupper() and k not in ("GIB", "MIB")}
        print(json.dumps({
            "model": asdict(shape) | {"params": shape.params}, "setting": asdict(setting),
            "gpu_memory_gib": args.gpu_memory_gib, "prediction": estimate.as_dict(),
            "longest_length": longest, "table": table, "constants": constants, "auto": auto,
            "note": "planner predictions (analytical model), not measurements",
        }, indent=1))  # fmt: skip
        return 0
    size = f"{shape.params / 1e9:.2f}B" if shape.params >= 1e8 else f"{shape.params / 1e6:.2f}M"
    print(f"{shape.name}: {size} parameters (hidden {shape.hidden}, {shape.layers} layers, "
          f"{shape.heads}/{shape.kv_heads} heads, intermediate {shape.intermediate}, vocab {shape.vocab}) on "
          f"{args.gpus} x {args.gpu_memory_gib:g} GiB")  # fmt: skip
    if shape.gdn_layers or shape.conv_layers:
        print(f"hybrid: {_hybrid(shape)}")
    if shape.sparse:
        print(f"sparse: {shape.sparse.describe(shape)}")
    if shape.vision:
        v = shape.vision
        print(f"vision tower: {v.params / 1e6:.1f}M parameters, {v.depth} blocks of {v.hidden}; "
              f"{args.image_share:.0%} of the row image placeholders ({v.patches_per_token} patches each), "
              "every rank encoding every image")  # fmt: skip
    print(f"setting: {_describe(setting, ulysses, ring)}")
    print("\n".join(breakdown_lines(shape, estimate, budget, setting.device)))
    print(f"    longest trainable length for this setting: {_tokens(longest)} tokens"
          + ("" if longest else " (does not fit)"))  # fmt: skip
    if auto is not None:
        kept = f"{auto['kept_layers']} of {auto['attention_layers']} attention layers"
        exchanges = f", {auto['kept_exchanges']} of them their all-to-all results too" if auto["kept_exchanges"] else ""
        plan = f"{kept} keep their outputs{exchanges}"
        if auto["offloaded_layers"]:
            plan = f"the first {auto['offloaded_layers']} of {shape.layers} layers offload their checkpointed inputs"
        print(f"    checkpoint_policy=auto (budget {args.gpu_memory_gib:g} GiB): the breakdown is full "
              f"checkpointing's, the first steps'; then {plan} at {length:,} tokens, "
              f"peak {auto['peak'] / GIB:.2f} GiB"
              + (" (does not fit)" if auto["peak"] > budget else " (none kept at the longest length)"))  # fmt: skip
    print(f"\n(b) longest trainable length (tokens; K = 1024; — = does not fit) on {args.gpus} x "
          f"{args.gpu_memory_gib:g} GiB, {'LoRA' if setting.lora else 'full fine-tuning'}, {setting.dtype}; "
          "columns: sp (ulysses x ring)")  # fmt: skip
    print("\n".join(table_lines(table)))
    overhead = planner.CUDA_OVERHEAD_GIB if setting.device == "cuda" else planner.CPU_RUNTIME_MIB * MIB / GIB
    print("\nRows add one memory-stack feature each; the last: all of them with checkpoint_policy=sequence_aware.\n"
          f"Predictions of an analytical model (hf_sp_trainer/planner/), not measurements (memory only, not step "
          f"time); {overhead:.2f} GiB of runtime / CUDA overhead assumed.")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
