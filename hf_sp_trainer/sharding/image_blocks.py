"""Image tokens that attend bidirectionally within their image (Gemma3): the extra pairs of the block plan.

Gemma3's text decoder lets the tokens of one image see each other, later ones included: its mask is
``causal OR same image`` on full-attention layers and ``window AND (causal OR same image)`` on sliding ones (an
image is a run of ``token_type_ids == 1``, as transformers' ``get_block_sequence_ids_for_mask`` groups them). A key
after its query always passes the window (``j > p - window``), so both masks are the causal one (per document, with
its window) plus the pairs ``p < j`` of one image. Those pairs are disjoint from the causal ones: the block plan
(``zigzag.plan_ring``) adds them as tasks of their own, merged with the log-sum-exp like every other block. With a
ring, a key chunk after the query chunk is then no longer skippable when it holds the rest of an image: it is a
``"full"`` task for that image's queries, and the diagonal chunk a ``"future"`` one (``p < j``).

Gemma4 (with ``use_bidirectional_attention="vision"``) does the same on its sliding layers only, for runs of image or
video tokens (``mm_token_type_ids`` 1 or 2); its full-attention layers stay causal. ``ImageBlockRule`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IMAGE_BLOCKS_KWARG = "sp_image_blocks"  # [n, 3] (row, start, end) of every image of the whole batch, global order
IMAGE_BLOCKS_MARK = "_hf_sp_image_blocks"  # set on the attention modules whose image tokens see their whole image


@dataclass(frozen=True)
class ImageBlockRule:
    """Which tokens of a VLM's text decoder see their whole image, and on which layers."""

    types_key: str  # the per-token input that marks them (``token_type_ids``, ``mm_token_type_ids``)
    media_types: tuple[int, ...]  # its values there; a run of such tokens is one image (one video frame)
    sliding_only: bool = False  # only on sliding-window layers (Gemma4); full-attention layers stay causal


def mark_image_block_layers(decoder: torch.nn.Module, rule: ImageBlockRule | None) -> None:
    """Mark the attention modules of ``decoder`` where ``rule``'s image tokens see their whole image (each attention
    module of a sliding-only rule names its ``layer_type``; checked, so a renamed attribute can't silently put the
    image pairs on every layer)."""
    typed = [m for m in decoder.modules() if isinstance(getattr(m, "layer_type", None), str)]
    if rule is not None and rule.sliding_only and not typed:
        raise ValueError(
            f"{type(decoder).__name__}: no attention module names its layer_type, so SP can't tell the sliding "
            "layers (whose image tokens see their whole image) from the causal full-attention ones."
        )
    for m in decoder.modules():
        sliding = getattr(m, "layer_type", None) == "sliding_attention"
        setattr(m, IMAGE_BLOCKS_MARK, rule is not None and (sliding or not rule.sliding_only))


Image = tuple[int, int, int]  # (row, start, end), global positions of one row


def image_blocks(token_type_ids: torch.Tensor, media_types: tuple[int, ...] = (1,)) -> torch.Tensor:
    """``[n, 3]`` long ``(row, start, end)`` of each run of ``token_type_ids`` in ``media_types`` in ``[b, S]`` (the
    whole sequence): the images whose tokens see each other."""
    is_image = torch.isin(token_type_ids, torch.tensor(media_types, device=token_type_ids.device)).to(torch.int8)
    edges = torch.diff(torch.nn.functional.pad(is_image, (1, 1)), dim=1)  # +1 where a run starts, -1 after it ends
    starts, ends = (edges == 1).nonzero(), (edges == -1).nonzero()
    return torch.stack([starts[:, 0], starts[:, 1], ends[:, 1]], dim=1)


def within_documents(images: list[list[int]] | tuple[Image, ...], segments: list[list[tuple[int, int]]]) -> list[Image]:
    """The images as ``(row, start, end)``, a run cut where a packed document starts inside it (each document is its
    own sequence: its images never see another document's). Runs of one token have no pair and are dropped."""
    out = []
    for row, start, end in images:
        cuts = [s for s, _ in segments[row] if start < s < end]
        edges = [start, *cuts, end]
        out += [(row, lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True) if hi - lo > 1]
    return out


def future_pairs(
    image: Image, q_chunk: tuple[int, int], k_chunk: tuple[int, int]
) -> tuple[str, tuple[int, int], tuple[int, int]] | None:
    """The pairs ``p < j`` of one image between a query chunk and a key chunk (global ranges) as
    ``(kind, queries, keys)``, trimmed so that every query and key sees one; ``None`` when there are none. Keys
    after the queries' chunk: ``"full"``; the same chunk: ``"future"``; an earlier chunk has none."""
    _, start, end = image
    q0, q1 = max(start, q_chunk[0]), min(end, q_chunk[1])
    k0, k1 = max(start, k_chunk[0]), min(end, k_chunk[1])
    if q0 >= q1 or k0 >= k1 or k_chunk[0] < q_chunk[0]:
        return None
    if k_chunk[0] >= q_chunk[1]:
        return "full", (q0, q1), (k0, k1)
    q1, k0 = min(q1, k1 - 1), max(k0, q0 + 1)  # the last key sees no later key; the first query none before it
    return ("future", (q0, q1), (k0, k1)) if q0 < q1 else None
