"""One-shot GPU check of the CUDA-only code paths, written as one JSON (``--out``, default gpu_check.json).

    python scripts/gpu_check.py                                   # one H200: under 8 minutes (--budget-s 420)
    python scripts/gpu_check.py --dry-run --out /tmp/check.json   # CPU, tiny sizes, CUDA-only parts skipped

a_kernels: packed rows (mixed lengths, 1-token documents, GQA), fp32/bf16, out/LSE/grads vs a dense fp64 reference:
the per-document sdpa path, torch ``varlen_attn``, flash-attn varlen, the ring block kernels (sdpa, varlen, flash;
causal, full, and "future": the rest of a Gemma3 image);
the ring op with attention sinks and with MLA head dims (q/k 192, v 128) on each kernel (``_gpu_attention.py``).
b_fused_loss: Liger's fused linear cross-entropy (if installed) and the chunked loss vs the plain loss.
c_offload: a small Llama step with gradient checkpointing, ``HostOffload`` on vs off (and off twice, the kernels' own
run-to-run noise): loss bitwise, gradients within that noise, peak memory.
d_long_context: one step (sp 1, bf16, AdamW, tiled MLP + fused loss + sequence-aware checkpointing) of a
Llama-3.1-8B-shaped model with 2 and 4 layers at 64K-256K tokens; the 32-layer extrapolation (its model is in the JSON).
e_hybrid: the hybrid layers' kernels (GDN, KDA, causal conv, Mamba1's and RG-LRU's scans; FLA / causal-conv1d /
mamba-ssm when installed) split the way SP splits a document (state summaries, conv halo) vs unsplit, and vs the fp32
torch kernels; fp32, TF32, bf16 (``_gpu_hybrid.py``).
f_vlm: a whole VLM step (Qwen2-VL-shaped, a packed row of three documents with images) under SP at sp 1 and at sp 2
(two processes on the one GPU over gloo; media whole and split) vs each document alone, fp32 and bf16: loss and every
gradient, the vision tower's included; and one long multimodal row's peak memory per rank (``_gpu_vlm.py``).
g_length: settings that switch on with length under SP on the GPU's kernel (torch varlen): Llama-4's chunked
attention and NoPE temperature, longrope's switch, DeepSeek-V3.2's sparse-attention top-k (sdpa, a boolean mask),
Qwen4-Exp's query-sparse budget with a PLE layer, DeepSeek-V4's window and compressed entries, at sp 1 and sp 2 vs
each document alone (``_gpu_length.py``).
h_auto: ``checkpoint_policy="auto"`` with a budget halfway between full and sequence-aware checkpointing, a
Llama-3.1-8B-shaped 4-layer stack at 64K tokens: peak, step time and kept layers of each policy (``_gpu_auto.py``).
i_varlen: one Gated DeltaNet layer (Qwen3.5's shape, bf16) of SP's delta rule on a 32K row of 1, 16 and 128 documents,
FLA's kernel once per document segment vs once per list (``cu_seqlens``): time, kernel calls, difference
(``bench_varlen.py``).
j_dsa_kernel: DSA's selected-keys attention (16 heads of MLA head dims, bf16, top-2048) on the dense masked kernel vs
the gathered one at 32K-128K tokens: time, peak and difference (``bench_dsa_kernel.py``), to place
``gathered_keys.GATHER_ABOVE`` on a GPU (measured on CPU only).
k_vllm: the CUDA side of the vLLM rollouts (where vLLM is installed): TRL's in-place weight sync vs the
``reload_weights`` path, per-request seeds, sleep mode (level-1 sleep / wake times, memory freed, the same completion
after waking) and generation throughput at 16K and 32K completions (``_gpu_vllm.py``).

Each check runs in its own process (default on CUDA), killed at the global budget: a crash, hang or broken CUDA
context is recorded and the next check still runs; one that doesn't fit the time left is skipped with a note. The
JSON is rewritten after every check. ``max_rel`` = max |got - ref| / max |ref|.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from _gpu_attention import sink_mla_checks
from _gpu_auto import auto_checks
from _gpu_hybrid import few_autotune_configs, hybrid_checks
from _gpu_length import length_checks
from _gpu_vllm import vllm_checks
from _gpu_vlm import vlm_checks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # hf_sp_trainer from a checkout

MIN_SECONDS = {
    "a_kernels": 20,
    "b_fused_loss": 20,
    "c_offload": 20,
    "d_long_context": 60,
    "e_hybrid": 20,
    "f_vlm": 40,
    "g_length": 30,
    "h_auto": 60,
    "i_varlen": 60,
    "j_dsa_kernel": 60,
    "k_vllm": 60,
}  # don't start with less
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}  # on max_rel
NEEDS_HALF, NO_FLASH = "needs CUDA and fp16/bf16", "flash-attn not installed"


@dataclass
class Ctx:
    device: torch.device
    dry: bool
    deadline: float  # time.time() by which everything must be done

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.time()

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """``fn()``, the peak memory while it ran (MiB; CPU: VmHWM, since the process start where it can't be reset)
        and its seconds, synchronized."""
        from _bench_common import peak_mb, reset_peak

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            with contextlib.suppress(OSError):
                reset_peak()
        start = time.perf_counter()
        result = fn()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return result, torch.cuda.max_memory_allocated() / 2**20 if self.cuda else peak_mb(), seconds


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def diffs(names: tuple[str, ...], got, ref, dtype: torch.dtype) -> dict[str, Any]:
    """``max_abs`` / ``max_rel`` of each ``got`` (None: skipped) vs ``ref``, and ``within_tol``."""
    out: dict[str, Any] = {}
    for name, g, r in zip(names, got, ref, strict=True):
        if g is not None:
            err = (g.detach().double() - r.detach().double()).abs().max().item()
            out[name] = {"max_abs": err, "max_rel": err / max(r.detach().double().abs().max().item(), 1e-30)}
    return out | {"within_tol": all(v["max_rel"] <= TOL[dtype] for v in out.values())}


def max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.detach().double()
    return (got.detach().double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def error(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


# -- (a) attention kernels on packed rows ------------------------------------------------------------------------
def dense_reference(q, k, v, dout, docs: list[int] | None, scale: float, future: bool = False):
    """fp64 attention with a dense mask (block-causal over ``docs``; None: every pair; ``future``: key ``j >= i``, the
    ring's ``"future"`` block of an image at offset -1): out, LSE, dq, dk, dv."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if future:
        pos = torch.arange(q.shape[2], device=q.device)
        s = s.masked_fill(pos[None] < pos[:, None], float("-inf"))
    elif docs is not None:
        doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs)).to(q.device)
        pos = torch.arange(len(doc), device=q.device)
        s = s.masked_fill(~((doc[:, None] == doc[None]) & (pos[:, None] >= pos[None])), float("-inf"))
    out = s.softmax(-1) @ v.repeat_interleave(g, 1)
    out.backward(dout.double())
    return out, s.logsumexp(-1), q.grad, k.grad, v.grad


def kernel_runs(ctx: Ctx, half: bool, cfg) -> dict[str, Any]:
    """name -> fn(q, k, v, dout, docs, scale) -> (out [b, hq, n, d], lse or None, dq, dk, dv); or why it is skipped."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import LlamaAttention

    from hf_sp_trainer.attention.block_attention import block_backward, block_forward
    from hf_sp_trainer.attention.kernels import run_kernel
    from hf_sp_trainer.documents import DocumentLayout

    module = LlamaAttention(cfg, layer_idx=0).to(ctx.device)

    def autograd(forward):
        def run(q, k, v, dout, docs, scale):
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            out = forward(q, k, v, docs, scale)
            out.backward(dout)
            return out, None, q.grad, k.grad, v.grad

        return run

    def per_doc_sdpa(q, k, v, docs, scale):
        layout = DocumentLayout.from_position_ids(torch.cat([torch.arange(n) for n in docs]).expand(q.shape[0], -1))
        kw = {"scaling": scale, "dropout": 0.0}
        return run_kernel("sdpa", AttentionInterface()["sdpa"], module, q, k, v, layout, kw).transpose(1, 2)

    def varlen(q, k, v, docs, scale, flash: bool = False):  # rows end to end: [b * n, h, d], one call, causal
        cu = torch.tensor([0, *itertools.accumulate(docs * q.shape[0])], dtype=torch.int32, device=q.device)
        args = (*(x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (q, k, v)), cu, cu, max(docs))
        if flash:
            from flash_attn import flash_attn_varlen_func

            out = flash_attn_varlen_func(*args, max(docs), softmax_scale=scale, causal=True)
        else:
            from torch.nn.attention.varlen import varlen_attn

            from hf_sp_trainer.attention.block_attention import _gqa_expanded, _varlen_takes_gqa

            gqa = {"enable_gqa": q.shape[1] != k.shape[1]} if _varlen_takes_gqa() else {}
            args = (args[0], *_gqa_expanded(args[0], *args[1:3]), *args[3:])
            out = varlen_attn(*args, max(docs), scale=scale, window_size=(-1, 0), **gqa)
        return out.reshape(q.shape[0], -1, *out.shape[1:]).transpose(1, 2)

    def block(kernel: str, kind: str):
        def run(q, k, v, dout, docs, scale):
            kw = dict(kind=kind, scale=scale, docs=tuple(docs) if kind == "causal" else (), kernel=kernel)
            kw["offset"] = -1 if kind == "future" else 0  # the rest of an image: keys one after the queries
            out, lse = block_forward(q, k, v, **kw)
            return (out, lse, *block_backward(dout, q, k, v, out, lse, **kw))

        return run

    flash = has("flash_attn")
    runs: dict[str, Any] = {"per_doc_sdpa": autograd(per_doc_sdpa), "torch_varlen": autograd(varlen) if half else
                            NEEDS_HALF, "flash_attn_varlen": NO_FLASH if not flash else NEEDS_HALF}  # fmt: skip
    if half and flash:
        runs["flash_attn_varlen"] = autograd(lambda *a: varlen(*a, flash=True))
    for kernel, kind in itertools.product(("sdpa", "varlen", "flash_attention_2"), ("causal", "full", "future")):
        skip = NO_FLASH if kernel == "flash_attention_2" and not flash else None
        skip = skip or (NEEDS_HALF if kernel != "sdpa" and not half else None)
        runs[f"block_{kernel}_{kind}"] = skip or block(kernel, kind)
    return runs


def check_kernels(ctx: Ctx) -> dict:
    from transformers import LlamaConfig

    if ctx.dry:
        docs, hq, hkv, d, full = [1, 7, 1, 1, 20, 3, 1], 4, 2, 16, (24, 40)
    else:
        docs, hq, hkv, d, full = [1, 130, 1, 1, 700, 257, 1, 1453, 64, 1, 391], 16, 4, 128, (384, 640)
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d)
    out: dict[str, Any] = {"docs": docs, "rows": 2, "heads": hq, "kv_heads": hkv, "head_dim": d, "full_block": full,
                           "tolerance_max_rel": {str(k)[6:]: v for k, v in TOL.items()}}  # fmt: skip
    gen = torch.Generator(ctx.device).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        results = out[str(dtype)[6:]] = {}
        for name, fn in kernel_runs(ctx, ctx.cuda and dtype != torch.float32, cfg).items():
            if isinstance(fn, str):
                results[name] = {"skipped": fn}
                continue
            is_full, future = name.endswith("_full"), name.endswith("_future")
            n_q, n_k = full if is_full else (full[0], full[0]) if future else (sum(docs), sum(docs))
            shapes = ((hq, n_q), (hkv, n_k), (hkv, n_k), (hq, n_q))
            q, k, v, dout = (torch.randn(2, h, n, d, generator=gen, device=ctx.device).to(dtype) for h, n in shapes)
            try:
                ref = dense_reference(q, k, v, dout, None if is_full else docs, d**-0.5, future)
                results[name] = diffs(("out", "lse", "dq", "dk", "dv"), fn(q, k, v, dout, docs, d**-0.5), ref, dtype)
            except Exception as exc:  # noqa: BLE001 - recorded; the other kernels still run
                results[name] = error(exc)
        dims = (hq, hkv, d, d // 2) if ctx.dry else (hq, hkv, 192, 128)  # MLA: DeepSeek-V3's q/k 192, v 128
        results |= sink_mla_checks(ctx.device, dtype, has("flash_attn"), diffs, error, dims)
    return out


# -- (b) fused linear cross-entropy --------------------------------------------------------------------------------
def loss_case(ctx: Ctx, dtype: torch.dtype, softcap: float | None, sizes: tuple[int, int, int], liger: bool) -> dict:
    """The plain loss (fp32 cross-entropy of the ``dtype`` logits) vs the chunked one and, with ``liger``, Liger's."""
    from unittest import mock

    from hf_sp_trainer.losses import fused as fused_loss

    tokens, hidden, vocab = sizes
    gen = torch.Generator(ctx.device).manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=ctx.device, dtype=dtype)
    x = torch.randn(tokens, hidden, generator=gen, device=ctx.device).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=ctx.device)
    targets[torch.rand(tokens, generator=gen, device=ctx.device) < 0.1] = -100

    def run(loss_fn) -> tuple:
        xs = x.detach().requires_grad_()
        head.zero_grad()
        loss, peak, _ = ctx.measure(lambda: backward(loss_fn(xs)))
        return (loss, xs.grad, head.weight.grad.clone()), peak

    def plain(xs):
        logits = head(xs)
        logits = logits if softcap is None else torch.tanh(logits / softcap) * softcap
        return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100)

    ref, ref_peak = run(plain)
    out: dict[str, Any] = {"plain_peak_mb": ref_peak}
    methods = {"chunked": lambda: mock.patch.object(fused_loss, "_liger_sum", return_value=None)}
    if liger:
        methods["liger"] = contextlib.nullcontext  # on CUDA with liger-kernel: the automatic choice
    for name, patch in methods.items():
        try:
            with patch():
                got, peak = run(lambda xs: fused_loss.fused_linear_cross_entropy(xs, targets, head, softcap=softcap))
            out[name] = diffs(("loss", "dx", "dweight"), got, ref, dtype) | {"peak_mb": peak}
        except Exception as exc:  # noqa: BLE001
            out[name] = error(exc)
    return out


def check_fused_loss(ctx: Ctx) -> dict:
    sizes = (256, 64, 1000) if ctx.dry else (8192, 4096, 128256)
    liger = ctx.cuda and has("liger_kernel")
    why = "needs CUDA" if not ctx.cuda else "liger-kernel not installed"
    out: dict[str, Any] = {"tokens_hidden_vocab": sizes, "liger": "compared" if liger else f"skipped: {why}"}
    for dtype, softcap in itertools.product((torch.float32, torch.bfloat16), (None, 30.0)):
        out[f"{str(dtype)[6:]}_softcap_{softcap}"] = loss_case(ctx, dtype, softcap, sizes, liger)
    return out


# -- (c) activation offloading -----------------------------------------------------------------------------------
def small_llama(ctx: Ctx, layers: int, **sizes):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, use_cache=False, **sizes)
    with ctx.device:
        dtype = torch.bfloat16 if ctx.cuda else torch.float32
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model.train()


def check_offload(ctx: Ctx) -> dict:
    from hf_sp_trainer.memory.checkpointing import wrap_checkpointed_layers
    from hf_sp_trainer.memory.offload import HostOffload

    layers, seq, hidden, mlp, heads = (2, 256, 64, 128, 4) if ctx.dry else (8, 32768, 2048, 5632, 16)
    sizes = dict(hidden_size=hidden, intermediate_size=mlp, num_attention_heads=heads, num_key_value_heads=heads // 4)
    model = small_llama(ctx, layers, vocab_size=1024, max_position_embeddings=seq, **sizes)
    ids = torch.randint(0, 1024, (1, seq), device=ctx.device)
    hooks = HostOffload() if ctx.cuda else HostOffload("cpu", min_bytes=0)  # "cpu": the same hooks, synchronous
    runs = {}  # "off_again": the control: how far two identical steps differ on this device's kernels
    for name, offload in (("off", None), ("off_again", None), ("on", hooks), ("on_again", hooks)):
        wrap_checkpointed_layers(model, None, offload)
        model.zero_grad(set_to_none=True)
        loss, peak, seconds = ctx.measure(lambda: backward(model(input_ids=ids, labels=ids).loss))
        grads = [p.grad.to("cpu", copy=True) for p in model.parameters()]  # kept off the device: peaks comparable
        runs[name] = (loss.to("cpu", copy=True), grads, peak, seconds)
    model.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"layers": layers, "seq": seq, **sizes, "offloaded_tensors": hooks.packed}
    for name in ("off_again", "on", "on_again"):
        pairs = list(zip(runs[name][1], runs["off"][1], strict=True))
        out[name] = {
            "loss_bitwise_equal": torch.equal(runs[name][0], runs["off"][0]),
            "grads_bitwise_equal": all(torch.equal(a, b) for a, b in pairs),
            "grads_max_rel": max(max_rel(a, b) for a, b in pairs),
        }
    out.update(peak_mb={n: r[2] for n, r in runs.items()}, seconds={n: r[3] for n, r in runs.items()})
    out["checkpoints_mb"] = layers * seq * hidden * (2 if ctx.cuda else 4) / 2**20  # what offloading can free
    noise = out["off_again"]["grads_max_rel"]  # nonzero where the backward kernels accumulate in a varying order
    out["within_tol"] = all(
        out[n]["loss_bitwise_equal"] and out[n]["grads_max_rel"] <= 4 * noise for n in ("on", "on_again")
    )
    if not ctx.cuda:
        out["note"] = "CPU: host offload frees no device memory; only the hooks' exactness is checked"
    return out


# -- (d) Llama-3.1-8B-shaped long-context step --------------------------------------------------------------------
def train_step(ctx: Ctx, model, opt, tokens: int) -> tuple[float, float]:
    """(peak MiB, seconds) of one forward + backward + optimizer step on one row of ``tokens`` tokens."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=ctx.device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return ctx.measure(step)[1:]


def check_long_context(ctx: Ctx, lengths: list[int]) -> dict:
    from bench_memory import LLAMA3_8B

    from hf_sp_trainer.integrations.throughput import (
        attention_geometry,
        device_peak_flops,
        matmul_params,
        training_flops,
    )
    from hf_sp_trainer.memory import enable_memory_features

    shape = {k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"}
    peak_flops = device_peak_flops(torch.cuda.get_device_name()) if ctx.cuda else None
    if ctx.dry:
        shape.update(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
        shape["vocab_size"] = 256
        lengths = [256, 512]
    memory = SimpleNamespace(tiled_mlp=True, tiled_mlp_num_shards=None, fused_loss=True, checkpoint_offloading=False,
                             checkpoint_policy="sequence_aware", gradient_checkpointing=True)  # fmt: skip
    runs: list[dict] = []
    last = None  # (tokens, seconds, layers) of the last step: predicts the next one's time
    for layers in (2, 4):
        model = small_llama(ctx, layers, max_position_embeddings=max(lengths), **shape)
        enable_memory_features(model, memory)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=ctx.cuda)
        train_step(ctx, model, opt, min(lengths) // 8)  # warm-up: allocates the optimizer states
        for n in lengths:
            run = {"layers": layers, "tokens": n}
            if last is not None and last[1] * (n / last[0]) ** 2 * layers / last[2] > ctx.left() - 30:
                runs.append(run | {"skipped": "predicted step time (quadratic in tokens) over the budget left"})
                break
            try:
                peak, seconds = train_step(ctx, model, opt, n)
            except Exception as exc:  # noqa: BLE001 - OOM (expected at some length) or a failure: recorded
                runs.append(run | {"oom" if isinstance(exc, torch.OutOfMemoryError) else "error": str(exc)[:500]})
                break
            flops = training_flops(n, n * (n + 1) / 2, *matmul_params(model), *attention_geometry(model.config))
            mfu = flops / seconds / peak_flops if peak_flops else None  # model FLOPs (ThroughputCallback's formula)
            runs.append(run | {"peak_mb": peak, "step_s": seconds, "tokens_per_s": n / seconds, "mfu": mfu})
            last = (n, seconds, layers)
        del model, opt
        if ctx.cuda:
            torch.cuda.empty_cache()
    return {"model": shape, "lengths": lengths, "optimizer": "AdamW, bf16 params and states (fp32 on CPU)",
            "memory_stack": vars(memory), "runs": runs, **extrapolate(ctx, runs)}  # fmt: skip


def extrapolate(ctx: Ctx, runs: list[dict]) -> dict:
    """The per-layer memory slope (2 vs 4 layers) and the longest length for 32 layers."""
    from _bench_common import available_mb

    peaks = {(r["layers"], r["tokens"]): r["peak_mb"] for r in runs if "peak_mb" in r}
    both = sorted(n for layers, n in peaks if layers == 2 and (4, n) in peaks)
    slopes = {n: (peaks[4, n] - peaks[2, n]) / 2 for n in both}
    peak_32 = {n: peaks[2, n] + 30 * slope for n, slope in slopes.items()}
    capacity = 0.95 * (torch.cuda.get_device_properties(0).total_memory / 2**20 if ctx.cuda else available_mb())
    ext: dict[str, Any] = {
        "model": "peak(L, s) = peak(2, s) + (L - 2) slope(s), slope(s) = (peak(4, s) - peak(2, s)) / 2; peak(32, s) "
        "linear in s through the two longest lengths measured with both layer counts, solved for capacity = 95% of "
        "the device memory; same memory stack and optimizer (full fine-tuning), sp 1, one document per row",
        "capacity_mb": capacity,
        "peak_32_layers_mb": peak_32,
        "longest_tokens_32_layers": None,
    }
    if len(both) < 2:
        return {"per_layer_slope_mb": slopes, "extrapolation": ext | {"note": "needs 2 lengths with 2 and 4 layers"}}
    (a, pa), (b, pb) = ((n, peak_32[n]) for n in both[-2:])
    per_token = (pb - pa) / (b - a)
    ext.update(fixed_mb_32_layers=pa - per_token * a, mb_per_1k_tokens_32_layers=per_token * 1024)
    if per_token > 0:
        ext["longest_tokens_32_layers"] = max(0, int((capacity - ext["fixed_mb_32_layers"]) / per_token))
    return {"per_layer_slope_mb": slopes, "extrapolation": ext}


def check_varlen(ctx: Ctx) -> dict:
    """``bench_varlen.varlen_timings``: Qwen3.5's GDN shape in bf16 at 32K tokens (CPU dry run: tiny, the loop only,
    transformers' torch path refusing ``cu_seqlens``)."""
    kept = few_autotune_configs() if ctx.cuda else 0  # before FLA's kernels are defined
    from bench_varlen import QWEN35_GDN, TINY, varlen_timings

    if ctx.dry:
        return varlen_timings(ctx.device, torch.float32, 64, [64, 8], TINY, repeats=1)
    result = varlen_timings(ctx.device, torch.bfloat16, 32768, [32768, 2048, 256], QWEN35_GDN, repeats=3)
    return result | {"autotune_configs_kept": kept}


def check_dsa_kernel(ctx: Ctx) -> dict:
    """``bench_dsa_kernel.compare`` over the length while time is left (CPU dry run: tiny, fp32)."""
    from bench_dsa_kernel import compare

    measure = ctx.measure
    if ctx.dry:
        return {"rows": [compare(256, 32, 2, ctx.device, torch.float32, 1, measure)]}
    compare(1024, 64, 16, ctx.device, torch.bfloat16, 1, measure)  # warm-up, not recorded
    rows = []
    for seq in (32768, 65536, 131072):
        start = time.time()
        rows.append(compare(seq, 2048, 16, ctx.device, torch.bfloat16, 2, measure))
        if ctx.left() < 5 * (time.time() - start):  # the next length takes ~4x as long (dense)
            break
    return {"rows": rows}


# -- running the checks --------------------------------------------------------------------------------------------
def run_check(name: str, ctx: Ctx, lengths: list[int]) -> dict:
    start = time.time()
    checks = {"a_kernels": check_kernels, "b_fused_loss": check_fused_loss, "c_offload": check_offload,
              "d_long_context": lambda c: check_long_context(c, lengths),
              "e_hybrid": lambda c: hybrid_checks(c.device, c.dry),
              "f_vlm": lambda c: vlm_checks(c.device, c.dry),
              "g_length": lambda c: length_checks(c.device, c.dry),
              "h_auto": lambda c: auto_checks(c, small_llama), "i_varlen": check_varlen,
              "j_dsa_kernel": check_dsa_kernel, "k_vllm": lambda c: vllm_checks(c.device, c.dry)}  # fmt: skip
    try:
        rec = {"status": "ok", "result": checks[name](ctx)}
    except Exception as exc:  # noqa: BLE001 - one failing check must not stop the others
        rec = {"status": "error", **error(exc), "traceback": traceback.format_exc()[-4000:]}
    if ctx.cuda:
        torch.cuda.empty_cache()
    return rec | {"seconds": round(time.time() - start, 2)}


def run_isolated(name: str, opts, deadline: float) -> dict:
    """``name`` in a child process, killed at the deadline."""
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--out", path, "--deadline", str(deadline),
               "--lengths", *map(str, opts.lengths), *(["--dry-run"] if opts.dry_run else [])]  # fmt: skip
        try:
            # stderr passes through: a check's progress lines reach the log even when it is killed at the deadline
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "note": "killed at the global budget", "seconds": round(time.time() - start)}
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    return {"status": "error", "error": f"the check's process exited with {done.returncode} and no result",
            "stdout_tail": done.stdout[-4000:], "seconds": round(time.time() - start, 2)}  # fmt: skip


def environment(device: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
           "flash_attn": has("flash_attn"), "liger_kernel": has("liger_kernel")}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes; CUDA-only parts are skipped")
    parser.add_argument("--budget-s", type=float, default=420.0, help="global time budget of all checks")
    parser.add_argument("--checks", nargs="+", default=list(MIN_SECONDS), choices=list(MIN_SECONDS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536, 131072, 262144], help="for d_long_context")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, help="one process per check (CUDA default)")
    parser.add_argument("--check-s", type=float, help="time cap of each check (else only the global budget)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not opts.dry_run else "cpu")
    ctx = Ctx(device=device, dry=opts.dry_run, deadline=opts.deadline or time.time() + opts.budget_s)
    if opts.child:
        with open(opts.out, "w") as f:
            json.dump(run_check(opts.child, ctx, opts.lengths), f, default=str)
        return
    if not opts.dry_run and not ctx.cuda:
        sys.exit("no CUDA device: use --dry-run for the CPU smoke run")
    isolate = ctx.cuda if opts.isolate is None else opts.isolate
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": opts.dry_run,
                              "budget_s": opts.budget_s, "isolated": isolate, "environment": environment(device),
                              "checks": {}}  # fmt: skip
    start = time.time()
    for name in opts.checks:
        if ctx.left() < MIN_SECONDS[name]:
            rec = {"status": "skipped", "note": f"global budget: {ctx.left():.0f} s left, needs {MIN_SECONDS[name]}"}
        else:
            print(f"[gpu_check] {name} ({ctx.left():.0f} s left)", flush=True)
            deadline = min(ctx.deadline, time.time() + (opts.check_s or ctx.left()))
            rec = run_isolated(name, opts, deadline) if isolate else run_check(name, ctx, opts.lengths)
        report["checks"][name] = rec
        report["elapsed_s"] = round(time.time() - start, 2)
        with open(opts.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"[gpu_check] {name}: {rec['status']} ({rec.get('seconds', 0)} s)", flush=True)


if __name__ == "__main__":
    main()
