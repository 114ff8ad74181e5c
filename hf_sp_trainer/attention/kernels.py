"""The inner attention kernel, run on the full sequence for this rank's heads, one document at a time.

Three ways to keep packed documents apart, chosen by the kernel:
- varlen kernels (flash_attention_*): one call with ``cu_seq_lens`` over the documents;
- flex_attention: one call with a block-sparse document mask;
- everything else (sdpa, eager, any registered key): one call per document with the kernel's own causal /
  sliding-window mask for that document's length, so no dense ``seq x seq`` mask is ever built.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    causal_mask_function,
    packed_sequence_mask_function,
    sliding_window_causal_mask_function,
)

from ..documents import DocumentLayout

# Keyword arguments describing the local shard's packing; the kernel gets full-sequence ones instead.
_SHARD_ONLY_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_varlen_kernel(kernel: str) -> bool:
    return "flash" in kernel


def resolve_kernel(kernel: str, module: torch.nn.Module) -> Callable:
    """The attention function registered under ``kernel``; ``eager`` is the model file's own function."""
    if kernel == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return AttentionInterface()[kernel]


def _causal_mask_fn(sliding_window: int | None) -> Callable:
    return causal_mask_function if sliding_window is None else sliding_window_causal_mask_function(sliding_window)


def _document_mask(kernel, module, length, sliding_window, dtype, device):
    """The mask ``kernel`` expects for one unpacked causal document (``None`` where the kernel is causal itself)."""
    if kernel not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[kernel](
        batch_size=1,
        q_length=length,
        kv_length=length,
        mask_function=_causal_mask_fn(sliding_window),
        attention_mask=None,
        allow_is_causal_skip=True,
        local_size=sliding_window,
        dtype=dtype,
        device=device,
        config=module.config,
    )


def run_kernel(
    kernel: str,
    fn: Callable,
    module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: DocumentLayout,
    kwargs: dict,
) -> torch.Tensor:
    """Attention of ``q, k, v`` ``[b, heads, seq, d]`` over the full sequence with the kernel ``fn`` registered as
    ``kernel``; returns ``[b, seq, heads, d]``."""
    kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ not in _SHARD_ONLY_KWARGS}
    sliding_window = kwargs.get("sliding_window")
    if is_varlen_kernel(kernel):
        return _run_varlen(fn, module, q, k, v, layout, kwargs)
    if kernel == "flex_attention":
        return _run_flex(fn, module, q, k, v, layout, sliding_window, kwargs)
    rows = []
    for r, segments in enumerate(layout.segments):
        lengths = [end - start for start, end in segments]
        # split (not slicing): its backward writes every document's gradient into one buffer, once
        docs = zip(*(t[r : r + 1].split(lengths, dim=2) for t in (q, k, v)), strict=True)
        parts = []
        for (q_doc, k_doc, v_doc), length in zip(docs, lengths, strict=True):
            mask = layout.cached(
                (kernel, length, sliding_window, q.dtype),
                lambda n=length: _document_mask(kernel, module, n, sliding_window, q.dtype, q.device),
            )
            out, _ = fn(module, q_doc, k_doc, v_doc, mask, **kwargs)
            parts.append(out)
        rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]


def _run_varlen(fn, module, q, k, v, layout, kwargs):
    b, _, s, _ = q.shape

    def rows_end_to_end(x):  # [b, h, s, d] -> [1, h, b*s, d]
        return x.transpose(0, 1).reshape(1, x.shape[1], b * s, x.shape[-1])

    cu, max_len = layout.cu_seq_lens()
    out, _ = fn(
        module,
        rows_end_to_end(q),
        rows_end_to_end(k),
        rows_end_to_end(v),
        None,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max_len,
        max_length_k=max_len,
        position_ids=layout.position_ids.reshape(1, -1),
        **kwargs,
    )
    return out.reshape(b, s, *out.shape[2:])


def _run_flex(fn, module, q, k, v, layout, sliding_window, kwargs):
    b, _, s, _ = q.shape

    def build():
        mask_fn = and_masks(_causal_mask_fn(sliding_window), packed_sequence_mask_function(layout.document_ids()))
        return ALL_MASK_ATTENTION_FUNCTIONS["flex_attention"](
            batch_size=b, q_length=s, kv_length=s, mask_function=mask_fn, attention_mask=None, device=q.device
        )

    block_mask = layout.cached(("flex_attention", sliding_window), build)
    out, _ = fn(module, q, k, v, block_mask, **kwargs)
    return out
