"""Image tokens that attend bidirectionally within their image (Gemma3), under Ulysses.

Gemma3's text decoder lets the tokens of one image see each other, later ones included: its mask is
``causal OR same image`` on full-attention layers and ``window AND (causal OR same image)`` on sliding ones (an
image is a run of ``token_type_ids == 1``, as transformers' ``get_block_sequence_ids_for_mask`` groups them). After
the Ulysses all-to-all a rank holds the whole sequence for its heads, so the kernel runs causal per document as for
any model, and the query rows of each image are then recomputed here: the image's queries against the keys from its
document's start (or the window's) to the image's end, which is exactly that mask. The causal rows they replace get
no gradient. With a ring a rank holds only part of the keys, and a "future" block holding the rest of an image could
no longer be skipped: refused (``check_image_blocks_split``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IMAGE_BLOCKS_KWARG = "sp_image_blocks"  # [n, 3] (row, start, end) of every image of the whole batch, global order


def image_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
    """``[n, 3]`` long ``(row, start, end)`` of each run of ``token_type_ids == 1`` in ``[b, S]`` (the whole
    sequence): the images whose tokens see each other."""
    is_image = (token_type_ids == 1).to(torch.int8)
    edges = torch.diff(torch.nn.functional.pad(is_image, (1, 1)), dim=1)  # +1 where a run starts, -1 after it ends
    starts, ends = (edges == 1).nonzero(), (edges == -1).nonzero()
    return torch.stack([starts[:, 0], starts[:, 1], ends[:, 1]], dim=1)


def attend_image_blocks(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    bounds: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``out [b, S, hq, dv]`` (causal per document) with the rows of every image in ``blocks`` recomputed: its
    queries (``q [b, hq, S, d]``) against the keys (``k``/``v [b, hkv, S, d]``, grouped heads not expanded) from its
    document's start, or ``sliding_window - 1`` before the image, to the image's end; in a window, key ``j`` serves
    query ``i`` when ``j > i - sliding_window``. ``bounds``: the document starts of the rows laid end to end, then
    ``rows x S`` (``sp_document_bounds``)."""
    if blocks.numel() == 0:
        return out
    b, seq, heads, dv = out.shape
    groups = q.shape[1] // k.shape[1]
    starts = bounds[:-1].tolist()
    index, rows = [], []
    for row, start, end, doc_start in _within_documents(blocks.tolist(), starts, seq):
        flat = row * seq + start
        lo = doc_start if sliding_window is None else max(doc_start, start - sliding_window + 1)
        keys = slice(lo, end)
        kb, vb = k[row : row + 1, :, keys], v[row : row + 1, :, keys]
        if groups > 1:
            kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
        mask = None
        if sliding_window is not None:
            query_pos = torch.arange(start, end, device=q.device)[:, None]
            key_pos = torch.arange(lo, end, device=q.device)[None]
            mask = key_pos > query_pos - sliding_window
        o = F.scaled_dot_product_attention(
            q[row : row + 1, :, start:end], kb, vb, attn_mask=mask, dropout_p=dropout, scale=scale
        )  # [1, hq, n, dv]
        rows.append(o[0].transpose(0, 1).to(out.dtype))
        index.append(torch.arange(flat, row * seq + end, device=out.device))
    flat_out = out.reshape(b * seq, heads, dv).index_copy(0, torch.cat(index), torch.cat(rows))
    return flat_out.view(b, seq, heads, dv)


def _within_documents(blocks: list[list[int]], starts: list[int], seq: int) -> list[tuple[int, int, int, int]]:
    """``(row, start, end, document start)`` per image, a run cut where a packed document starts inside it (each
    document is its own sequence: its images never see another document's)."""
    out = []
    for row, start, end in blocks:
        offset = row * seq
        cuts = [s - offset for s in starts if offset + start < s < offset + end]
        edges = [start, *cuts, end]
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            out.append((row, lo, hi, max(s for s in starts if s <= offset + lo) - offset))
    return out
