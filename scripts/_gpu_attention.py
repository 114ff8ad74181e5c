"""gpu_check's attention sinks and MLA checks (part of ``a_kernels``): the ring attention op (a ring of one, so one
process) with per-head sinks and with a value head dim != the q/k head dim, on every block kernel path, vs fp64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def dense_sink_reference(q, k, v, dout, sinks, docs: list[int], scale: float):
    """fp64 block-causal attention over ``docs`` (``v`` may have its own head dim), sinks (or None) as gpt-oss's eager
    appends them: one more logit column dropped after the softmax. Returns out [b, hq, n, dv], dq, dk, dv, dsinks."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    sinks = sinks.detach().double().requires_grad_() if sinks is not None else None
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs)).to(q.device)
    pos = torch.arange(len(doc), device=q.device)
    s = s.masked_fill(~((doc[:, None] == doc[None]) & (pos[:, None] >= pos[None])), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:3], 1)], -1)
    out = s.softmax(-1)[..., : k.shape[2]] @ v.repeat_interleave(g, 1)
    out.backward(dout.double())
    return out, q.grad, k.grad, v.grad, sinks.grad if sinks is not None else None


def sink_mla_checks(
    device: torch.device, dtype: torch.dtype, flash: bool, diffs: Callable, error: Callable, dims: tuple[int, ...]
) -> dict[str, Any]:
    """``ring_op_{sinks,mla,mla_sinks}_{kernel}``: out and dq/dk/dv (and dsinks) of ``ring_attention`` vs fp64, for
    the kernels sdpa (CPU: the fused kernel; CUDA: varlen or math), varlen and flash_attention_2 (CUDA, half)."""
    from hf_sp_trainer.attention.ring import ring_attention

    hq, hkv, dqk, dv_mla = dims
    docs = [1, 7, 1, 20, 3, 1, 1] if device.type == "cpu" else [1, 130, 1, 700, 257, 1, 1453, 391]  # even sums
    half = device.type == "cuda" and dtype != torch.float32
    gen = torch.Generator(device).manual_seed(1)
    results: dict[str, Any] = {}
    for kernel in ("sdpa", "varlen", "flash_attention_2"):
        for variant, dv, with_sinks in (("sinks", dqk, True), ("mla", dv_mla, False), ("mla_sinks", dv_mla, True)):
            name = f"ring_op_{variant}_{kernel}"
            if kernel != "sdpa" and not half:
                results[name] = {"skipped": "needs CUDA and fp16/bf16"}
                continue
            if kernel == "flash_attention_2" and not flash:
                results[name] = {"skipped": "flash-attn not installed"}
                continue
            n = sum(docs)
            shapes = ((hq, n, dqk), (hkv, n, dqk), (hkv, n, dv), (hq, n, dv))
            q, k, v, dout = (torch.randn(2, h, s, d, generator=gen, device=device).to(dtype) for h, s, d in shapes)
            sinks = torch.randn(hq, generator=gen, device=device) * 2 + 2 if with_sinks else None  # fp32, as gpt-oss
            try:
                ref = dense_sink_reference(q, k, v, dout, sinks, docs, dqk**-0.5)
                x = [t.detach().requires_grad_() for t in (q, k, v)]
                s_ = sinks.detach().requires_grad_() if with_sinks else None
                segments = [[(a, a + m) for a, m in zip(_starts(docs), docs, strict=True)]] * 2
                out = ring_attention(*x, segments, None, scale=dqk**-0.5, kernel=kernel, sinks=s_).transpose(1, 2)
                out.backward(dout)
                got = (out, *(t.grad for t in x), s_.grad if with_sinks else None)
                results[name] = diffs(("out", "dq", "dk", "dv", "dsinks"), got, ref, dtype)
            except Exception as exc:  # noqa: BLE001 - recorded; the other kernels still run
                results[name] = error(exc)
    return results


def _starts(docs: list[int]) -> list[int]:
    out, total = [], 0
    for n in docs:
        out.append(total)
        total += n
    return out
