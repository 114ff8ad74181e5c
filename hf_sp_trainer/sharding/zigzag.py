"""Zigzag layout of a sequence over a ring, and the plan of the attention blocks each ring rank computes.

The padded sequence of length ``S`` is cut into ``2R`` chunks of ``c = S // (2R)`` tokens; ring rank ``i`` holds
chunks ``i`` and ``2R-1-i`` (in that order), so that every rank gets the same amount of causal attention work.

The planner lists, for every ring step ``t`` (when rank ``i`` holds the K/V of ring rank ``(i - t) mod R``), the
sub-blocks that contain visible (query, key) pairs: per-document causal squares on the diagonal, and rectangles of
one document (optionally cut to a sliding-window band) between a query chunk and an earlier key chunk; with images
that see themselves whole (Gemma3, ``image_blocks``), each image's pairs ``p < j`` too. Pairs of chunks without a
visible key are skipped. Pure Python: the same plan drives the ring kernel and ``measure_work``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .image_blocks import Image, future_pairs, within_documents

Range = tuple[int, int]


# -- layout -------------------------------------------------------------------------------------------------------
def chunk_pair(rank: int, ring_size: int) -> tuple[int, int]:
    """The two zigzag chunks held by ``rank``: ``(rank, 2R - 1 - rank)``."""
    if not 0 <= rank < ring_size:
        raise ValueError(f"ring rank {rank} out of range for a ring of {ring_size}")
    return rank, 2 * ring_size - 1 - rank


def zigzag_ranges(seq_len: int, ring_size: int, rank: int) -> list[Range]:
    """Global ``[start, end)`` ranges of ``rank``'s portion, in local order (one range when ``R == 1``)."""
    if ring_size == 1:  # no ring: the whole sequence, of any length (odd ones at sp 1 or an odd Ulysses degree)
        return [(0, seq_len)]
    if seq_len % (2 * ring_size):
        raise ValueError(f"sequence length {seq_len} must be a multiple of 2 * ring size = {2 * ring_size}")
    c = seq_len // (2 * ring_size)
    return [(j * c, (j + 1) * c) for j in chunk_pair(rank, ring_size)]


def contiguous_ranges(seq_len: int, ring_size: int, rank: int) -> list[Range]:
    """The plain split: rank ``i`` holds ``[i S/R, (i+1) S/R)`` (for comparison with zigzag)."""
    if seq_len % ring_size:
        raise ValueError(f"sequence length {seq_len} must be a multiple of the ring size {ring_size}")
    n = seq_len // ring_size
    return [(rank * n, (rank + 1) * n)]


def zigzag_permutation(seq_len: int, ring_size: int) -> torch.Tensor:
    """``perm[p]`` = global position of position ``p`` of the rank-major concatenation of the portions."""
    parts = [torch.arange(s, e) for i in range(ring_size) for s, e in zigzag_ranges(seq_len, ring_size, i)]
    return torch.cat(parts)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv[perm[p]] = p``: gather with ``inv`` to put rank-major data back in global order."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def zigzag_inverse_permutation(seq_len: int, ring_size: int) -> torch.Tensor:
    return inverse_permutation(zigzag_permutation(seq_len, ring_size))


# -- plan -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockTask:
    """One sub-block: queries ``q`` (local range in this rank's portion) x keys ``k`` (local range in the held
    portion) of batch rows ``rows``. ``kind``: ``"causal"`` (equal ranges; documents of lengths ``docs``, each
    causal, sliding window applied inside), ``"full"`` (every pair visible), ``"band"`` (keys before queries,
    sliding-window mask) or ``"future"`` (keys after queries: the pairs ``p < j`` of one image).
    ``q_start``/``k_start``: global positions of the first query/key."""

    rows: Range
    q: Range
    k: Range
    kind: str
    q_start: int
    k_start: int
    docs: tuple[int, ...] = ()

    @property
    def offset(self) -> int:
        """Global distance ``p - j`` between the first query and the first key."""
        return self.q_start - self.k_start


@dataclass(frozen=True)
class RingPlan:
    """Sub-block tasks of ring rank ``rank`` for every step; ``steps[t]`` uses the K/V of ``(rank - t) mod R``."""

    seq_len: int
    ring_size: int
    rank: int
    sliding_window: int | None
    steps: tuple[tuple[BlockTask, ...], ...]
    skipped: int  # (query chunk, key chunk) pairs with no visible key, over all steps and row groups


def _row_groups(segments: list[list[Range]]) -> list[tuple[Range, list[Range]]]:
    """Consecutive rows with the same documents share their tasks."""
    groups: list[tuple[Range, list[Range]]] = []
    for r, row in enumerate(segments):
        if groups and groups[-1][1] == row:
            groups[-1] = ((groups[-1][0][0], r + 1), row)
        else:
            groups.append(((r, r + 1), list(row)))
    return groups


def _pair_tasks(rows, row, q_chunk, q_local, k_chunk, k_local, window) -> list[BlockTask]:
    """Tasks of one (query chunk, key chunk) pair; empty when no key is visible."""
    (qs, qe), (ks, ke) = q_chunk, k_chunk
    if ks >= qe:  # keys entirely after the queries
        return []
    if (qs, qe) == (ks, ke):
        docs = tuple(min(e, qe) - max(s, qs) for s, e in row if s < qe and e > qs)
        return [BlockTask(rows, (q_local, q_local + qe - qs), (k_local, k_local + ke - ks), "causal", qs, ks, docs)]
    if ke > qs:
        raise ValueError(f"chunks {q_chunk} and {k_chunk} overlap without being equal")
    doc = next((s, e) for s, e in row if s <= qs < e)  # only the document holding qs can reach back to keys < qs
    q0, q1, k0, k1 = qs, min(doc[1], qe), max(doc[0], ks), ke
    kind = "full"
    if window is not None:
        q1, k0 = min(q1, k1 - 1 + window), max(k0, q0 - window + 1)  # queries / keys that see something
        kind = "full" if (q1 - 1) - k0 < window else "band"
    if q1 <= q0 or k1 <= k0:
        return []
    q_range, k_range = (q_local + q0 - qs, q_local + q1 - qs), (k_local + k0 - ks, k_local + k1 - ks)
    return [BlockTask(rows, q_range, k_range, kind, q0, k0)]


def plan_ring(
    segments: list[list[Range]],
    seq_len: int,
    ring_size: int,
    rank: int,
    sliding_window: int | None = None,
    layout: str = "zigzag",
    images: tuple[Image, ...] = (),
) -> RingPlan:
    """The sub-block tasks of ``rank`` at every ring step for packed rows ``segments`` (global coordinates);
    ``images``: ``(row, start, end)`` runs whose tokens see each other (``image_blocks.image_blocks``)."""
    ranges = {"zigzag": zigzag_ranges, "contiguous": contiguous_ranges}[layout]
    for row in segments:
        bounds = [0] + [e for _, e in row]
        if not row or bounds[-1] != seq_len or any(s != b for (s, _), b in zip(row, bounds, strict=False)):
            raise ValueError(f"segments must tile [0, {seq_len}) with contiguous documents, got {row}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
    images = tuple(within_documents(images, segments))
    mine = ranges(seq_len, ring_size, rank)
    steps, skipped = [], 0
    for t in range(ring_size):
        held = ranges(seq_len, ring_size, (rank - t) % ring_size)
        tasks: list[BlockTask] = []
        for rows, row in _row_groups(segments):
            for q_chunk, q_local, k_chunk, k_local in _chunk_pairs(mine, held):
                found = _pair_tasks(rows, row, q_chunk, q_local, k_chunk, k_local, sliding_window)
                skipped += not found
                tasks += found
        for q_chunk, q_local, k_chunk, k_local in _chunk_pairs(mine, held) if images else ():
            tasks += _image_tasks(images, q_chunk, q_local, k_chunk, k_local)
        steps.append(tuple(tasks))
    return RingPlan(seq_len, ring_size, rank, sliding_window, tuple(steps), skipped)


def _chunk_pairs(mine: list[Range], held: list[Range]) -> list[tuple[Range, int, Range, int]]:
    """Every (query chunk, its local start, key chunk, its local start) of this rank's and the held portion."""
    q_starts = [sum(e - s for s, e in mine[:i]) for i in range(len(mine))]
    k_starts = [sum(e - s for s, e in held[:i]) for i in range(len(held))]
    return [(q, ql, k, kl) for q, ql in zip(mine, q_starts, strict=True) for k, kl in zip(held, k_starts, strict=True)]


def _image_tasks(images: tuple[Image, ...], q_chunk: Range, q_local: int, k_chunk: Range, k_local: int):
    """One task per image with pairs ``p < j`` between the two chunks (a single row each)."""
    tasks = []
    for image in images:
        found = future_pairs(image, q_chunk, k_chunk)
        if found is not None:
            kind, (q0, q1), (k0, k1) = found
            q_range = (q_local + q0 - q_chunk[0], q_local + q1 - q_chunk[0])
            k_range = (k_local + k0 - k_chunk[0], k_local + k1 - k_chunk[0])
            tasks.append(BlockTask((image[0], image[0] + 1), q_range, k_range, kind, q0, k0))
    return tasks


# -- work ---------------------------------------------------------------------------------------------------------
def visible_pairs(task: BlockTask, window: int | None) -> int:
    """Number of visible (query, key) pairs of ``task`` for one row."""
    nq, nk = task.q[1] - task.q[0], task.k[1] - task.k[0]
    if task.kind == "full":
        return nq * nk
    if task.kind == "future":  # key b serves query a when b > a + offset
        return sum(max(0, nk - max(0, a + task.offset + 1)) for a in range(nq))
    if task.kind == "causal":
        w = window or 0
        return sum(n * (n + 1) // 2 if not w or w >= n else w * (w + 1) // 2 + (n - w) * w for n in task.docs)
    q0, q1, k0, k1 = task.q_start, task.q_start + nq, task.k_start, task.k_start + nk
    start = min(q1, max(q0, k0 + window))  # queries from here on see keys [p - window + 1, k1) only
    n = max(0, q1 - start)
    return (start - q0) * nk + n * (k1 + window - 1) - n * (start + q1 - 1) // 2


@dataclass(frozen=True)
class RankWork:
    rank: int
    pairs: int  # visible (query, key) pairs computed over all steps and rows (per head)
    calls: int  # kernel calls on CPU (one per document of a causal block, one per rectangle; rows share them)
    skipped: int  # chunk pairs skipped because no key is visible


def measure_work(
    segments: list[list[Range]], seq_len: int, ring_size: int, sliding_window: int | None = None, layout="zigzag"
) -> list[RankWork]:
    """Per-rank attention work of a ring over ``segments`` with the ``"zigzag"`` or ``"contiguous"`` layout."""
    work = []
    for rank in range(ring_size):
        plan = plan_ring(segments, seq_len, ring_size, rank, sliding_window, layout)
        tasks = [task for step in plan.steps for task in step]
        rows = [task.rows[1] - task.rows[0] for task in tasks]
        pairs = sum(n * visible_pairs(task, sliding_window) for n, task in zip(rows, tasks, strict=True))
        calls = sum(len(task.docs) if task.kind == "causal" else 1 for task in tasks)  # rows share a call
        work.append(RankWork(rank, pairs, calls, plan.skipped))
    return work
