"""Attention of one sub-block with its log-sum-exp, and its backward given the final (merged) output and LSE.

A sub-block is ``q [b, hq, nq, d]`` x ``k, v [b, hkv, nk, d]`` (GQA: query head ``h`` uses kv head
``h // (hq // hkv)``) of one of four kinds (see ``zigzag.BlockTask``): ``"causal"`` (equal ranges, documents of
lengths ``docs``, each causal), ``"full"`` (every pair visible), ``"band"`` (sliding-window band; ``offset`` is the
global distance between the first query and the first key; visible pairs: ``0 <= p - j < window``) or ``"future"``
(keys after their query, ``p - j < 0``: the rest of an image that sees itself whole).

The backward is flash-attention's: with the final ``out`` and ``lse`` of the whole row, ``P = exp(S - lse)`` is the
block's slice of the final softmax, so a block's dq/dk/dv are exactly its contribution to the full gradients.

Paths: CPU ``sdpa`` -> the fused CPU flash kernel; ``eager`` and soft-capping -> an explicit math path in fp32
(fp64 for fp64 inputs). CUDA (NOT RUN ON A GPU YET): ``sdpa``/``eager`` -> ``torch.nn.attention.varlen`` in
fp16/bf16 (math otherwise), ``varlen`` -> the same, ``flash_attention_2``/``_3`` -> flash-attn's varlen kernels.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools

import torch

LSE_KERNELS = ("sdpa", "eager", "varlen", "flash_attention_2", "flash_attention_3")
_FLASH_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
MATH_TILE = 1024  # query rows per step of the math path (bounds its score matrix)

Rect = tuple[int, int, int, int, bool, str]  # q0, q1, k0, k1, causal, mask ("", "band" or "future")


def check_kernel(kernel: str, device: torch.device | str, softcap: float | None = None) -> None:
    """Raise a ``ValueError`` if ring attention can't run ``kernel`` on ``device`` (no communication)."""
    device = torch.device(device)
    if kernel not in LSE_KERNELS:
        raise ValueError(
            f"ring attention needs a kernel that returns the log-sum-exp of each query row to merge the blocks of "
            f"the ring; {kernel!r} does not. Use one of {LSE_KERNELS}."
        )
    if kernel in ("varlen", *_FLASH_MODULES) and device.type != "cuda":
        raise ValueError(f"ring attention kernel {kernel!r} needs a CUDA device (got {device}); use 'sdpa' or 'eager'.")
    if kernel == "varlen" and softcap:
        raise ValueError("torch varlen attention has no soft-capping; use 'eager' or 'flash_attention_2'.")
    if kernel in _FLASH_MODULES and importlib.util.find_spec(_FLASH_MODULES[kernel]) is None:
        raise ValueError(f"ring attention kernel {kernel!r} needs the {_FLASH_MODULES[kernel]!r} package installed.")


def _path(kernel: str, q: torch.Tensor, softcap: float | None) -> str:
    if kernel == "varlen" and q.dtype not in (torch.float16, torch.bfloat16):
        return "math"  # flash kernels take half precision only; fp32 runs the exact math path
    if kernel in _FLASH_MODULES or kernel == "varlen":
        return kernel
    if softcap or (kernel == "eager" and q.device.type != "cuda"):
        return "math"
    if q.device.type == "cuda":
        return "varlen" if q.dtype in (torch.float16, torch.bfloat16) else "math"
    return "fused"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _rects(kind: str, nq: int, nk: int, docs: tuple[int, ...], window: int | None) -> list[Rect]:
    if kind in ("full", "band", "future"):
        return [(0, nq, 0, nk, False, "" if kind == "full" else kind)]
    starts = itertools.accumulate(docs[:-1], initial=0)
    band = lambda n: "band" if window is not None and window < n else ""  # noqa: E731
    return [(s, s + n, s, s + n, True, band(n)) for s, n in zip(starts, docs, strict=True)]


def _visible(nq: int, nk: int, offset: int, window: int | None, device, future: bool = False) -> torch.Tensor:
    """``[nq, nk]`` bool: ``0 <= p - j < window`` (``future``: ``p - j < 0``) with ``p - j = a - b + offset``."""
    dist = torch.arange(nq, device=device)[:, None] - torch.arange(nk, device=device)[None] + offset
    if future:
        return dist < 0
    return (dist >= 0) & (dist < window) if window is not None else dist >= 0


def _rect_mask(rect: Rect, offset: int, window: int | None, device, causal_as_mask: bool) -> torch.Tensor | None:
    """The rectangle's bool mask; ``None`` when every pair is visible (or causal, unless ``causal_as_mask``)."""
    q0, q1, k0, k1, causal, masked = rect
    if masked or (causal and causal_as_mask):
        return _visible(q1 - q0, k1 - k0, offset + q0 - k0, window, device, future=masked == "future")
    return None


# -- math path (fp32) ---------------------------------------------------------------------------------------------
def _scores(q, k, scale, softcap, mask):
    """Scores ``[b, hkv, g, nq, nk]`` (masked with -inf) and the soft-cap's tanh (or None)."""
    b, hq, nq, d = q.shape
    s = q.reshape(b, k.shape[1], hq // k.shape[1], nq, d) @ k.unsqueeze(2).transpose(-1, -2) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    return (s if mask is None else s.masked_fill(~mask, float("-inf"))), t


def _math_forward(q, k, v, scale, softcap, mask):
    dt = acc_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    outs, lses = [], []
    for a in range(0, q.shape[2], MATH_TILE):
        s, _ = _scores(q[:, :, a : a + MATH_TILE], k, scale, softcap, None if mask is None else mask[a : a + MATH_TILE])
        lse = s.logsumexp(-1)
        outs.append(torch.exp(s - lse[..., None]) @ v.unsqueeze(2))
        lses.append(lse)
    b, hq = q.shape[:2]
    return torch.cat(outs, 3).reshape(b, hq, -1, v.shape[3]), torch.cat(lses, 3).reshape(b, hq, -1)


def _math_backward(dout, q, k, v, out, lse, scale, softcap, mask):
    dt = acc_dtype(q.dtype)
    dout, q, k, v, out, lse = (x.to(dt) for x in (dout, q, k, v, out, lse))
    b, hq, nq, d = q.shape
    hkv, dv_ = k.shape[1], v.shape[3]
    g = hq // hkv
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, nq, MATH_TILE):
        rows = slice(a, a + MATH_TILE)
        s, t = _scores(q[:, :, rows], k, scale, softcap, None if mask is None else mask[rows])
        do = dout[:, :, rows].reshape(b, hkv, g, -1, dv_)
        p = torch.exp(s - lse[:, :, rows].reshape(b, hkv, g, -1, 1))
        dv += (p.transpose(-1, -2) @ do).sum(2)
        delta = (do * out[:, :, rows].reshape(b, hkv, g, -1, dv_)).sum(-1, keepdim=True)
        ds = p * (do @ v.unsqueeze(2).transpose(-1, -2) - delta)
        if t is not None:
            ds = ds * (1 - t * t)
        dq[:, :, rows] = (ds @ k.unsqueeze(2)).reshape(b, hq, -1, d) * scale
        dk += (ds.transpose(-1, -2) @ q[:, :, rows].reshape(b, hkv, g, -1, d)).sum(2) * scale
    return dq, dk, dv


# -- fused CPU flash kernel ---------------------------------------------------------------------------------------
def _additive(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """The fused kernel takes an additive mask of the query's dtype (a bool mask is refused)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -torch.inf)


def _fused_forward(q, k, v, scale, causal, mask):
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return kernel(q, k, v, 0.0, causal and mask is None, attn_mask=_additive(mask, q.dtype), scale=scale)


def _fused_backward(dout, q, k, v, out, lse, scale, causal, mask):
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    lse, is_causal = lse.to(acc_dtype(q.dtype)), causal and mask is None
    return kernel(dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=_additive(mask, q.dtype), scale=scale)


# -- CUDA varlen kernels: NOT RUN ON A GPU YET (written against torch 2.13's varlen.py and flash-attn's interface) --
def _packed(x: torch.Tensor) -> torch.Tensor:
    """``[b, h, n, d]`` -> ``[b * n, h, d]``: the rows laid end to end (varlen layout)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _unpacked(x: torch.Tensor, b: int) -> torch.Tensor:
    return x.reshape(b, -1, *x.shape[1:]).transpose(1, 2)


def _heads_first(lse: torch.Tensor, heads: int, total: int) -> torch.Tensor:
    """Flash kernels return the varlen LSE as ``(heads, total)``; accept ``(total, heads)`` too."""
    return lse.t() if lse.shape == (total, heads) and heads != total else lse


def _varlen_geometry(kind, b, nq, nk, offset, docs, window, device):
    """cu_seqlens (q, k), max lengths and flash's ``(left, right)`` window of one sub-block, rows end to end.

    Flash aligns a ``nq x nk`` window to the bottom right: query ``a`` sees keys ``[a + nk - nq - left,
    a + nk - nq + right]``. For a band (keys before queries, ``p - j = a - b + offset``) that is ``right = offset +
    nq - nk`` (the distance between the last query and the last key) and ``left = window - 1 - right`` (>= 0: the
    planner trims queries that see nothing). For ``"future"`` (``p < j``: key ``b >= a + offset + 1``) that is
    ``left = nk - nq - offset - 1`` (>= 0: the planner trims the last key of the queries) and no right edge."""
    if kind == "causal":
        lens_q = lens_k = list(docs) * b
        win = (window - 1 if window is not None else -1, 0)
    else:
        lens_q, lens_k = [nq] * b, [nk] * b
        right = offset + nq - nk
        win = (-1, -1)
        if kind == "band":
            win = (window - 1 - right, right)
        elif kind == "future":
            win = (nk - nq - offset - 1, -1)

    def cu(lens):
        return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)

    return cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), win


@functools.cache
def _varlen_takes_gqa() -> bool:
    """torch 2.13's ``varlen_attn`` takes ``enable_gqa``; earlier ones (2.11) need as many kv heads as q heads."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _gqa_expanded(q: torch.Tensor, *kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Packed ``[t, hkv, d]`` k / v repeated to q's heads where the installed ``varlen_attn`` lacks ``enable_gqa``."""
    group = q.shape[1] // kv[0].shape[1]
    if group == 1 or _varlen_takes_gqa():
        return kv
    return tuple(x.repeat_interleave(group, dim=1) for x in kv)


def _gqa_reduced(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`_gqa_expanded`: the q heads of each kv head summed back to ``heads``."""
    t, h, d = grad.shape
    return grad if h == heads else grad.view(t, heads, h // heads, d).sum(2)


def _varlen_forward(path, q, k, v, geometry, scale, softcap, causal):
    cu_q, cu_k, max_q, max_k, win = geometry
    if path == "varlen":
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        kw = dict(return_aux=AuxRequest(lse=True), scale=scale, window_size=win)
        if _varlen_takes_gqa():
            kw["enable_gqa"] = q.shape[1] != k.shape[1]
        k, v = _gqa_expanded(q, k, v)
        return varlen_attn(q, k, v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=max_q, max_k=max_k, **kw)
    if path == "flash_attention_2":
        from flash_attn import flash_attn_varlen_func

        out, lse, _ = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            softmax_scale=scale, causal=causal, window_size=win, softcap=softcap or 0.0, return_attn_probs=True,
        )  # fmt: skip
        return out, lse
    from flash_attn_interface import _flash_attn_forward

    out, lse, *_ = _flash_attn_forward(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scale,
        causal=causal, window_size_left=win[0], window_size_right=win[1], softcap=softcap or 0.0,
    )  # fmt: skip
    return out, lse


def _varlen_backward(path, dout, q, k, v, out, lse, geometry, scale, softcap, causal):
    cu_q, cu_k, max_q, max_k, win = geometry
    if path == "varlen":
        import torch.nn.attention.varlen  # noqa: F401 - registers torch.ops.torch_attn

        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        op = torch.ops.torch_attn._varlen_attn_backward
        heads = k.shape[1]
        k, v = _gqa_expanded(q, k, v)
        dq, dk, dv = op(
            dout, q, k, v, out, lse, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=max_q, max_k=max_k,
            is_causal=win == (-1, 0), rng_state=rng_state, scale=scale, window_size=list(win),
        )  # fmt: skip
        return dq, _gqa_reduced(dk, heads), _gqa_reduced(dv, heads)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(softmax_scale=scale, window_size_left=win[0], window_size_right=win[1], softcap=softcap or 0.0)
    if path == "flash_attention_2":
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        _flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
            max_seqlen_k=max_k, dropout_p=0.0, causal=causal, alibi_slopes=None, deterministic=False, **common,
        )  # fmt: skip
    else:
        from flash_attn_interface import _flash_attn_backward

        _flash_attn_backward(
            dout, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            dq=dq, dk=dk, dv=dv, is_causal=causal, **common,
        )  # fmt: skip
    return dq, dk, dv


# -- value head dim != query/key head dim (MLA) -------------------------------------------------------------------
def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _needs_padding(path: str, q: torch.Tensor, v: torch.Tensor) -> bool:
    """The fused and flash kernels take one head size for q, k and v; the math path takes any ``dv``. Zero columns
    appended to V (and dout/out) change neither the scores, the LSE nor the gradients of the other columns; zero
    columns appended to q and k (``dv > dqk``) change no score (the scale is passed explicitly)."""
    return path != "math" and q.shape[-1] != v.shape[-1]


# -- one sub-block ------------------------------------------------------------------------------------------------
def _joined(parts: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The rectangles' results along the query rows (no copy for a single one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kind: str,
    scale: float,
    offset: int = 0,
    docs: tuple[int, ...] = (),
    window: int | None = None,
    softcap: float | None = None,
    kernel: str = "sdpa",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sub-block: ``out [b, hq, nq, dv]`` and ``lse [b, hq, nq]`` (fp32, fp64 for fp64 inputs).
    Every query row must see at least one key (the planner guarantees it)."""
    path = _path(kernel, q, softcap)
    if _needs_padding(path, q, v):
        width, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        geometry = dict(kind=kind, scale=scale, offset=offset, docs=docs, window=window, softcap=softcap, kernel=kernel)
        out, lse = block_forward(*(_pad_last(x, width) for x in (q, k, v)), **geometry)
        return out[..., :dv], lse
    b, hq, nq, _ = q.shape
    if path in ("math", "fused"):
        outs, lses = [], []
        for rect in _rects(kind, nq, k.shape[2], docs, window):
            q0, q1, k0, k1, causal, _ = rect
            mask = _rect_mask(rect, offset, window, q.device, causal_as_mask=path == "math")
            args = (q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], scale)
            out, lse = _math_forward(*args, softcap, mask) if path == "math" else _fused_forward(*args, causal, mask)
            outs.append(out)
            lses.append(lse.to(acc_dtype(q.dtype)))
        return _joined(outs), _joined(lses)
    geometry = _varlen_geometry(kind, b, nq, k.shape[2], offset, docs, window, q.device)
    out, lse = _varlen_forward(path, _packed(q), _packed(k), _packed(v), geometry, scale, softcap, kind == "causal")
    lse = _heads_first(lse, hq, b * nq).reshape(hq, b, nq).transpose(0, 1)
    return _unpacked(out, b), lse.float()


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    kind: str,
    scale: float,
    offset: int = 0,
    docs: tuple[int, ...] = (),
    window: int | None = None,
    softcap: float | None = None,
    kernel: str = "sdpa",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one sub-block, given ``dout``, the FINAL ``out`` (input dtype) and ``lse`` of its
    query rows: exactly the block's contribution to the gradients of the whole attention."""
    path = _path(kernel, q, softcap)
    if _needs_padding(path, q, v):
        width, dqk, dv = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
        geometry = dict(kind=kind, scale=scale, offset=offset, docs=docs, window=window, softcap=softcap, kernel=kernel)
        padded = (_pad_last(x, width) for x in (dout, q, k, v, out))
        gq, gk, gv = block_backward(*padded, lse, **geometry)
        return gq[..., :dqk], gk[..., :dqk], gv[..., :dv]
    b, hq, nq, _ = q.shape
    if path in ("math", "fused"):
        grads = []
        for rect in _rects(kind, nq, k.shape[2], docs, window):
            q0, q1, k0, k1, causal, _ = rect
            mask = _rect_mask(rect, offset, window, q.device, causal_as_mask=path == "math")
            qs, ks = slice(q0, q1), slice(k0, k1)
            rows = (dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs])
            if path == "math":
                grads.append(_math_backward(*rows, scale, softcap, mask))
            else:
                grads.append(_fused_backward(*rows, scale, causal, mask))
        return tuple(_joined(parts) for parts in zip(*grads, strict=True))  # type: ignore[return-value]
    geometry = _varlen_geometry(kind, b, nq, k.shape[2], offset, docs, window, q.device)
    lse = lse.float().transpose(0, 1).reshape(hq, b * nq).contiguous()
    packed = (_packed(x) for x in (dout, q, k, v, out))
    dq, dk, dv = _varlen_backward(path, *packed, lse, geometry, scale, softcap, kind == "causal")
    return _unpacked(dq, b), _unpacked(dk, b), _unpacked(dv, b)
