"""GPU check of the hybrid layers' kernels as SP uses them (``hf_sp_trainer.mixers``), for ``gpu_check.py``.

SP splits a document over runs and relies on two kernel facts: the chunked delta rule (GDN, KDA) is affine in its
initial state column by column (one call on values ``[v | 0]`` from ``[0 | I]`` gives a run's output, final state
and transition ``M``), with the gradient reaching the initial state; and the causal conv equals itself on a run with
the ``W - 1`` inputs before it prepended. Each case splits one document at ``split``, runs the SP algorithm on the
device's kernels (flash-linear-attention / causal-conv1d when installed: transformers' hub wrappers pick them), and
compares output, final state and input gradients with the unsplit call on the same device; the unsplit call is also
compared with transformers' torch kernel in fp32 (TF32 off) on the same device. Mamba1's selective scan (mamba-ssm's
CUDA ``selective_scan_fn`` when installed) takes no initial state: its split adds the closed-form correction SP
uses; so does RecurrentGemma's RG-LRU scan (torch only). fp32 with TF32 off and on, bf16.

On CUDA, Triton's autotuner keeps only the first ``HF_SP_GPU_AUTOTUNE_CONFIGS`` (default 1) configs of each kernel,
patched before FLA is imported: every config computes the same maths, and compiling and timing all of FLA's (a first
256-token GDN forward took 56 s on an H200) does not fit a device session. Set it to 0 to keep them all.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from typing import Any

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()  # the CPU reference meets device results here
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _torch_only(function):
    """transformers' own torch function: SP's swap and transformers' hub / package dispatch (FLA, causal-conv1d,
    mamba-ssm: ``use_kernel_func_from_hub_with_fallback`` wraps the torch function with ``functools.wraps``) peeled."""
    function = getattr(function, "_hf_sp_original", function)
    return getattr(function, "__wrapped__", function)


def _torch_reference(reference, inputs, device):
    """transformers' torch kernel in fp32 with TF32 off, on ``device`` (the CPU would take minutes at these sizes)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            return reference([t.to(device, torch.float32, copy=True) for t in inputs])[0]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _split_vs_whole(names, inputs, probe, whole, split, device, dtype, reference) -> dict[str, float]:
    """``whole(tensors) -> (output, final state)`` on ``device`` / ``dtype`` and ``reference`` (the same with the torch
    kernel, fp32), ``split(tensors)`` (``whole`` computed as SP splits the document) on fresh copies of ``inputs``:
    the output's, final state's and every input gradient's ``max_rel`` (each copy its own leaf, so no gradient is
    compared with itself)."""

    def copies(dev, dt):
        return [t.to(dev, dt, copy=True).requires_grad_() for t in inputs]

    ref = _torch_reference(reference, inputs, device)
    full_in = copies(device, dtype)
    full, final = whole(full_in)
    (full.float() * probe.to(device)).sum().backward()
    parts = copies(device, dtype)
    got, got_final = split(parts)
    (got.float() * probe.to(device)).sum().backward()
    result = {"vs_torch_fp32": _rel(full, ref), "split_out": _rel(got, full), "split_final": _rel(got_final, final)}
    for name, a, b in zip(names, parts, full_in, strict=True):
        result[f"split_d{name}"] = _rel(a.grad, b.grad)
    return result


def _delta_rule_case(core, torch_core, kda: bool, device, dtype, sizes) -> dict[str, float]:
    total, split, heads, k_dim, v_dim = sizes
    gen = torch.Generator().manual_seed(0)
    k_heads = heads if kda else max(1, heads // 2)
    q, k = (torch.randn(1, total, k_heads, k_dim, generator=gen) for _ in range(2))
    v = torch.randn(1, total, heads, v_dim, generator=gen)
    g = -0.05 * torch.rand(1, total, heads, *((k_dim,) if kda else ()), generator=gen)
    beta = torch.rand(1, total, heads, generator=gen)
    probe = torch.randn(v.shape, generator=gen)
    opts = dict(use_qk_l2norm_in_kernel=True)

    def whole(t):
        return core(*t, output_final_state=True, **opts)

    def as_sp(parts):  # the widened [v | 0] call from [0 | I], and the correction from the incoming state
        first = [t[:, :split] for t in parts]
        rest = [t[:, split:] for t in parts]
        out1, state = core(*first, output_final_state=True, **opts)
        widened = torch.cat([rest[2], rest[2].new_zeros(*rest[2].shape[:-1], k_dim)], -1)
        eye = torch.eye(k_dim, device=device)
        init = torch.cat([eye.new_zeros(k_dim, v_dim), eye], -1).expand(1, heads, k_dim, -1).contiguous()
        out2, summary = core(
            rest[0], rest[1], widened, rest[3], rest[4], initial_state=init, output_final_state=True, **opts
        )
        zeros = torch.zeros_like(rest[2])
        correction, _ = core(rest[0], rest[1], zeros, rest[3], rest[4], initial_state=state, **opts)
        got = torch.cat([out1, out2[..., :v_dim] + correction], 1)
        return got, summary[..., v_dim:] @ state.float() + summary[..., :v_dim]

    names, inputs = ("q", "k", "v", "g", "beta"), (q, k, v, g, beta)
    reference = lambda t: torch_core(*t, output_final_state=True, **opts)  # noqa: E731
    return _split_vs_whole(names, inputs, probe, whole, as_sp, device, dtype, reference)


def _conv_case(conv, torch_conv, device, dtype, sizes) -> dict[str, float]:
    total, split, channels = sizes[0], sizes[1], sizes[2] * sizes[4]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, channels, total, generator=gen)
    w, b = torch.randn(channels, 4, generator=gen), torch.randn(channels, generator=gen)
    dev = [t.to(device, dtype) for t in (x, w, b)]
    full = conv(dev[0], dev[1], dev[2], activation="silu")
    halo = conv(dev[0][:, :, split - 3 :], dev[1], dev[2], activation="silu")[:, :, 3:]
    ref = _torch_reference(lambda t: (torch_conv(*t, activation="silu"),), (x, w, b), device)
    return {"vs_torch_fp32": _rel(full, ref), "split_out": _rel(halo, full[:, :, split:])}


def _selective_case(scan, torch_scan, device, dtype, sizes) -> dict[str, float]:
    """Mamba1: a document split at ``split``; the rest scanned from zero plus the closed-form correction of the state
    it continues from (``selective_scan.state_output``), against the unsplit scan (output, final state, gradients)."""
    from hf_sp_trainer.mixers.selective_scan import discretised_steps, state_output

    total, split, d, n_state = min(sizes[0], 2048), min(sizes[1], 1300), sizes[2] * sizes[4] * 4, 16
    gen = torch.Generator().manual_seed(0)
    u, delta, z = (torch.randn(1, d, total, generator=gen) for _ in range(3))
    A = -torch.rand(d, n_state, generator=gen) * 0.2
    B, C = (torch.randn(1, n_state, total, generator=gen) for _ in range(2))
    D, bias = torch.randn(d, generator=gen), torch.randn(d, generator=gen) * 0.1 - 2
    probe = torch.randn(1, d, total, generator=gen)

    def call(x, dt_, b, c, z_, kernel=scan):
        return kernel(x, dt_, A.to(x.device), b, c, D=D.to(x.device), z=z_, delta_bias=bias.to(x.device),
                      delta_softplus=True, return_last_state=True)  # fmt: skip

    def as_sp(parts):  # the rest from zero, plus the closed-form output of the state it continues from
        out1, state = call(*(t[..., :split] for t in parts))
        rest = [t[..., split:] for t in parts]
        out2, last2 = call(*rest)
        steps = discretised_steps(rest[1], bias.to(device), True)
        gate = torch.nn.functional.silu(rest[4].float())
        out2 = out2 + (state_output(A.to(device), steps, rest[3], state.float()) * gate).to(out2.dtype)
        final = torch.exp(A.to(device)[None] * steps.sum(-1)[..., None]) * state.float() + last2.float()
        return torch.cat([out1, out2], -1), final

    names, inputs = ("u", "delta", "B", "C", "z"), (u, delta, B, C, z)
    reference = lambda t: call(*t, kernel=torch_scan)  # noqa: E731
    return _split_vs_whole(names, inputs, probe, lambda t: call(*t), as_sp, device, dtype, reference)


def _rg_lru_case(scan, torch_scan, device, dtype, sizes) -> dict[str, float]:
    """RecurrentGemma's RG-LRU scan: a document split at ``split``; the rest from zero plus ``cumprod(a) ⊙ S`` of the
    state it continues from (``rg_lru.sp_rnn_scan``'s correction), against the unsplit scan."""
    total, split, width = sizes[0], sizes[1], sizes[2] * sizes[4]
    gen = torch.Generator().manual_seed(0)
    x, a = torch.randn(1, total, width, generator=gen), 0.9 + 0.1 * torch.rand(1, total, width, generator=gen)
    reset = torch.zeros(1, total, 1, dtype=torch.bool)
    probe = torch.randn(x.shape, generator=gen)

    def call(x_, a_, state=None, kernel=scan):
        return kernel(None, hidden_states=x_, recurrent_gate=a_, reset=reset[:, : x_.shape[1]].to(x_.device),
                      recurrent_states=state)  # fmt: skip

    def as_sp(parts):  # the rest from zero, plus cumprod(a) of the state it continues from
        out1, state = call(parts[0][:, :split], parts[1][:, :split])
        rest_a = parts[1][:, split:]
        out2, last2 = call(parts[0][:, split:], rest_a)
        out2 = out2 + (rest_a.float().cumprod(1) * state[:, None]).to(out2.dtype)
        return torch.cat([out1, out2], 1), rest_a.float().prod(1) * state + last2

    reference = lambda t: call(*t, kernel=torch_scan)  # noqa: E731
    return _split_vs_whole(("x", "a"), (x, a), probe, lambda t: call(*t), as_sp, device, dtype, reference)


def few_autotune_configs() -> int:
    """Keep the first ``HF_SP_GPU_AUTOTUNE_CONFIGS`` configs of every Triton autotuner created from now on (0: all);
    returns the number kept (0: unpatched, or no Triton)."""
    import os

    keep = int(os.environ.get("HF_SP_GPU_AUTOTUNE_CONFIGS", "1"))
    if keep <= 0 or importlib.util.find_spec("triton") is None or any(m.startswith("fla.") for m in sys.modules):
        return 0  # (FLA imported already: its autotuners exist, all kept)
    from triton.runtime import autotuner

    init = autotuner.Autotuner.__init__

    def first_configs(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, list(configs)[:keep], *args, **kwargs)

    autotuner.Autotuner.__init__ = first_configs
    return keep


def hybrid_checks(device: torch.device, dry: bool) -> dict[str, Any]:
    """Every case: ``{name: max_rel figures}`` (or the error), with which kernels transformers picked."""
    kept = few_autotune_configs() if device.type == "cuda" else 0  # before FLA's kernels are defined
    from transformers.models.jamba import modeling_jamba as jamba
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rgemma

    original = lambda f: getattr(f, "_hf_sp_original", f)  # noqa: E731 - transformers' own, not SP's swap
    sizes = (40, 23, 2, 8, 6) if dry else (4096, 2500, 8, 128, 128)  # tokens, split, heads, k dim, v dim
    out: dict[str, Any] = {
        "fla": importlib.util.find_spec("fla") is not None,
        "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
        "mamba_ssm": importlib.util.find_spec("mamba_ssm") is not None,
        "sizes_tokens_split_heads_k_v": sizes,
        "autotune_configs_kept": kept or "all",
    }
    modes = [("fp32", torch.float32, False), ("fp32_tf32", torch.float32, True), ("bf16", torch.bfloat16, False)]
    for label, dtype, tf32 in modes if device.type == "cuda" else modes[:1]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        cases = {  # (case, the kernel transformers dispatches to, its torch function, ...)
            "gdn": (_delta_rule_case, qwen.torch_chunk_gated_delta_rule, False),
            "conv": (_conv_case, qwen.causal_conv1d_fn),
            "mamba1_scan": (_selective_case, jamba.mamba_selective_scan),
            "rg_lru_scan": (_rg_lru_case, rgemma.RecurrentGemmaRglru._rnn_scan),
            "kda": (_delta_rule_case, kimi.chunk_kimi_delta_attention, True),  # last: the slowest to compile
        }
        for name, (case, kernel, *args) in cases.items():
            started = time.time()
            try:
                out[f"{name}_{label}"] = case(original(kernel), _torch_only(kernel), *args, device, dtype, sizes)
            except Exception as exc:  # noqa: BLE001 - one failing kernel must not hide the others
                out[f"{name}_{label}"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            seconds = out.setdefault("seconds_per_case", {})[f"{name}_{label}"] = round(time.time() - started, 2)
            figures = json.dumps(out[f"{name}_{label}"])
            print(f"[e_hybrid] {name}_{label} ({seconds} s): {figures}", file=sys.stderr, flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    return out
