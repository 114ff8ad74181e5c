"""Ring attention: zigzag layout, block kernels with LSE, the block planner, and the ring over spawned gloo processes
against dense single-device attention (forward output and dq/dk/dv)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from hf_sp_trainer.attention.block_attention import block_backward, block_forward, check_kernel
from hf_sp_trainer.attention.ring import merge_block, ring_attention
from hf_sp_trainer.sharding.zigzag import (
    contiguous_ranges,
    measure_work,
    plan_ring,
    visible_pairs,
    zigzag_inverse_permutation,
    zigzag_permutation,
    zigzag_ranges,
)
from tests.harness import BF16_TOL, EXACT, FP64_EXACT, run_distributed, unwrap_results

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

S = 48  # 2R chunks of 6 tokens for R = 4, of 12 for R = 2


# -- dense reference --------------------------------------------------------------------------------------------
def visibility(segments: list[list[tuple[int, int]]], seq: int, window: int | None, images=()) -> torch.Tensor:
    """``[b, seq, seq]`` bool: same document, inside the sliding window, and causal or both in one of ``images``
    (``(row, start, end)`` runs: Gemma3's ``window AND (causal OR same image)``)."""
    p, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    masks = []
    for r, row in enumerate(segments):
        doc = torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(row)])
        image = torch.full((seq,), -1)
        for i, (_, start, end) in enumerate(im for im in images if im[0] == r):
            image[start:end] = i
        same_image = (image[:, None] == image[None]) & (image[:, None] >= 0)
        in_window = (p - j < window) if window else True  # a later key always is
        masks.append((doc[:, None] == doc[None]) & in_window & ((j <= p) | same_image))
    return torch.stack(masks)


def random_images(rng: random.Random, rows: int, seq: int) -> list[tuple[int, int, int]]:
    """Runs of image tokens as the collator's ``token_type_ids`` make them (``image_blocks``), crossing documents."""
    from hf_sp_trainer.sharding.image_blocks import image_blocks

    types = torch.tensor([[int(rng.random() < 0.4) for _ in range(seq)] for _ in range(rows)])
    return [tuple(b) for b in image_blocks(types).tolist()]


def masked_scores(q, k, mask, scale, softcap=None):
    """``[b, hq, sq, sk]`` scores (GQA by repeat_interleave, as transformers' repeat_kv), -inf where invisible."""
    scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return scores.masked_fill(~mask[:, None], float("-inf"))


def dense_attention(q, k, v, mask, scale, softcap=None, sinks=None):
    """Plain softmax attention of ``[b, h, s, d]`` inputs (v: ``[b, hkv, s, dv]``) with an explicit ``[b, sq, sk]``
    mask; ``[b, s, h, dv]``. ``sinks [h]``: gpt-oss's eager form, one more logit column dropped after the softmax."""
    scores = masked_scores(q, k, mask, scale, softcap)
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    probs = scores.softmax(-1)[..., : mask.shape[-1]]
    return (probs @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)).transpose(1, 2)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max())


def random_segments(rng: random.Random, seq: int, max_docs: int = 7) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, seq), rng.randint(0, min(seq - 1, max_docs - 1))))
    bounds = [0, *cuts, seq]
    return list(zip(bounds, bounds[1:], strict=False))


# -- layout and planner -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq,ring", [(8, 1), (8, 2), (48, 4), (24, 3)])
def test_zigzag_permutation_round_trip(seq, ring):
    perm, inv = zigzag_permutation(seq, ring), zigzag_inverse_permutation(seq, ring)
    assert torch.equal(perm[inv], torch.arange(seq)) and torch.equal(inv[perm], torch.arange(seq))
    n = seq // ring
    for r in range(ring):
        expected = torch.cat([torch.arange(s, e) for s, e in zigzag_ranges(seq, ring, r)])
        assert torch.equal(perm[r * n : (r + 1) * n], expected)
    x = torch.randn(2, seq, 3)
    assert torch.equal(x[:, perm][:, inv], x)


def test_zigzag_ranges():
    assert zigzag_ranges(16, 1, 0) == [(0, 16)]
    assert zigzag_ranges(13, 1, 0) == [(0, 13)]  # no ring: any length (sp 1 on CPU's block kernels)
    assert [zigzag_ranges(16, 4, r) for r in range(4)] == [
        [(0, 2), (14, 16)], [(2, 4), (12, 14)], [(4, 6), (10, 12)], [(6, 8), (8, 10)]
    ]  # fmt: skip
    assert contiguous_ranges(16, 4, 1) == [(4, 8)]
    with pytest.raises(ValueError, match="multiple of 2"):
        zigzag_ranges(12, 4, 0)


def _task_mask(task, qp: torch.Tensor, kp: torch.Tensor, window: int | None) -> torch.Tensor:
    """The pairs a task computes, from its kind alone."""
    dist = qp[:, None] - kp[None]
    if task.kind in ("future", "full"):
        return dist < 0 if task.kind == "future" else torch.ones_like(dist, dtype=torch.bool)
    mask = (dist >= 0) & ((dist < window) if window else True)
    if task.kind == "causal":
        doc = torch.repeat_interleave(torch.arange(len(task.docs)), torch.tensor(task.docs))
        mask &= doc[:, None] == doc[None]
    return mask


def _plan_coverage(segments, seq, ring, window, layout, images=()):
    """How often the plans of all ranks compute each (query, key) pair; every task must compute visible pairs only."""
    ranges = {"zigzag": zigzag_ranges, "contiguous": contiguous_ranges}[layout]
    counts = torch.zeros(len(segments), seq, seq, dtype=torch.long)
    visible = visibility(segments, seq, window, images)
    for rank in range(ring):
        plan = plan_ring(segments, seq, ring, rank, window, layout, images=tuple(images))
        queries = torch.cat([torch.arange(s, e) for s, e in ranges(seq, ring, rank)])
        for t, step in enumerate(plan.steps):
            keys = torch.cat([torch.arange(s, e) for s, e in ranges(seq, ring, (rank - t) % ring)])
            for task in step:
                qp, kp = queries[task.q[0] : task.q[1]], keys[task.k[0] : task.k[1]]
                assert (qp[0], kp[0]) == (task.q_start, task.k_start)
                mask = _task_mask(task, qp, kp, window)
                if task.kind != "causal":  # every query and key of a rectangle sees one; a band isn't full
                    assert mask.any(1).all() and mask.any(0).all()
                    assert mask.all() if task.kind == "full" else task.kind == "future" or not mask.all()
                assert int(mask.sum()) == visible_pairs(task, window)
                for r in range(*task.rows):
                    assert not (mask & ~visible[r][qp[:, None], kp[None]]).any(), (task, r)
                    counts[r, qp[:, None].expand_as(mask)[mask], kp[None].expand_as(mask)[mask]] += 1
    return counts


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_plan_computes_each_visible_pair_exactly_once(layout):
    rng = random.Random(0)
    for _ in range(25):
        ring = rng.choice([1, 2, 3, 4])
        seq = 2 * ring * rng.randint(1, 5)
        segments = [random_segments(rng, seq) for _ in range(rng.randint(1, 3))]
        window = rng.choice([None, 1, 2, 3, 7, 100])
        counts = _plan_coverage(segments, seq, ring, window, layout)
        assert torch.equal(counts, visibility(segments, seq, window).long()), (segments, ring, window)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_plan_with_images_computes_each_visible_pair_exactly_once(layout):
    """Gemma3's images (runs of image tokens, across documents and chunks) add their pairs ``p < j``: with a ring
    the chunk after the queries' is no longer skipped when it holds the rest of an image."""
    rng, changed = random.Random(1), 0
    for _ in range(25):
        ring = rng.choice([1, 2, 3, 4])
        seq = 2 * ring * rng.randint(1, 5)
        segments = [random_segments(rng, seq, max_docs=3) for _ in range(rng.randint(1, 3))]
        images = random_images(rng, len(segments), seq)
        window = rng.choice([None, 1, 3, 100])
        counts = _plan_coverage(segments, seq, ring, window, layout, images)
        want = visibility(segments, seq, window, images).long()
        assert torch.equal(counts, want), (segments, images, ring, window)
        changed += not torch.equal(want, visibility(segments, seq, window).long())
    assert changed >= 15, changed  # most draws hold images with pairs p < j: not a vacuous test


def test_plan_skips_invisible_pairs_and_zigzag_balances_work():
    zigzag, contiguous = measure_work([[(0, 64)]], 64, 4), measure_work([[(0, 64)]], 64, 4, layout="contiguous")
    assert len({w.pairs for w in zigzag}) == 1  # one document: every rank computes the same number of pairs
    assert sum(w.pairs for w in zigzag) == sum(w.pairs for w in contiguous) == 64 * 65 // 2
    assert max(w.pairs for w in contiguous) > 6 * min(w.pairs for w in contiguous)
    assert [w.skipped for w in contiguous] == [3, 2, 1, 0] and all(w.skipped == 7 for w in zigzag)
    # documents that never cross a chunk boundary: only the diagonal blocks remain
    plan = plan_ring([[(0, 4), (4, 8), (8, 12), (12, 16)]], 16, 2, 0)
    assert [len(step) for step in plan.steps] == [2, 0] and plan.skipped == 6
    # a sliding window shorter than a chunk: only the adjacent chunk's band is left
    plan = plan_ring([[(0, 16)]], 16, 2, 1, sliding_window=3)
    assert [(t.kind, t.q, t.k) for t in plan.steps[1]] == [("band", (0, 2), (2, 4))]


# -- block kernel -------------------------------------------------------------------------------------------------
BLOCKS = {  # kind, nq, nk, offset, docs, window
    "causal_docs": ("causal", 12, 12, 0, (3, 1, 6, 2), None),
    "causal_window": ("causal", 12, 12, 0, (3, 9), 4),
    "full": ("full", 5, 7, 9, (), None),
    "band": ("band", 6, 7, 8, (), 10),
    "future": ("future", 6, 7, -1, (), None),  # the rest of an image: keys after their query
}


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("hkv,softcap", [(4, None), (1, None), (2, 3.0)])
def test_block_kernel_matches_softmax(kernel, block, hkv, softcap):
    kind, nq, nk, offset, docs, window = BLOCKS[block]
    torch.manual_seed(0)
    q = torch.randn(2, 4, nq, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, hkv, nk, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dist = torch.arange(nq)[:, None] - torch.arange(nk)[None] + offset
    mask = (dist < 0) if kind == "future" else (dist >= 0) & ((dist < window) if window else True)
    if docs:
        doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        mask &= doc[:, None] == doc[None]
    mask = mask.expand(2, nq, nk)
    ref = dense_attention(q, k, v, mask, 0.4, softcap).transpose(1, 2)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    geometry = dict(kind=kind, scale=0.4, offset=offset, docs=docs, window=window, softcap=softcap, kernel=kernel)
    with torch.no_grad():
        out, lse = block_forward(q, k, v, **geometry)
        grads = block_backward(dout, q, k, v, out, lse, **geometry)
        ref_lse = masked_scores(q, k, mask, 0.4, softcap).logsumexp(-1)
    assert rel_err(out, ref) < FP64_EXACT and rel_err(lse, ref_lse) < FP64_EXACT
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert rel_err(got, want) < FP64_EXACT


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("block", ["causal_docs", "band", "future"])
@pytest.mark.parametrize("dv", [6, 12])
def test_block_kernel_value_head_dim_differs(kernel, block, dv):
    """MLA: ``dv != dqk`` (zero-padded around the fused kernel, native in the math path) fwd + bwd, exact."""
    kind, nq, nk, offset, docs, window = BLOCKS[block]
    torch.manual_seed(3)
    q = torch.randn(2, 4, nq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, nk, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, nk, dv, dtype=torch.float64, requires_grad=True)
    dist = torch.arange(nq)[:, None] - torch.arange(nk)[None] + offset
    mask = (dist < 0) if kind == "future" else (dist >= 0) & ((dist < window) if window else True)
    if docs:
        doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        mask &= doc[:, None] == doc[None]
    ref = dense_attention(q, k, v, mask.expand(2, nq, nk), 0.4).transpose(1, 2)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    geometry = dict(kind=kind, scale=0.4, offset=offset, docs=docs, window=window, kernel=kernel)
    with torch.no_grad():
        out, lse = block_forward(q, k, v, **geometry)
        grads = block_backward(dout, q, k, v, out, lse, **geometry)
    assert out.shape == ref.shape and rel_err(out, ref) < FP64_EXACT
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert got.shape == want.shape and rel_err(got, want) < FP64_EXACT


def test_ring_attention_refuses_bad_shapes():
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match="head dim"):
        ring_attention(q, torch.randn(1, 2, 8, 6), k, [[(0, 8)]], None, scale=1.0)  # k's head dim != q's
    with pytest.raises(ValueError, match="head dim"):
        ring_attention(q, k, torch.randn(1, 2, 7, 8), [[(0, 8)]], None, scale=1.0)  # v's length != k's
    with pytest.raises(ValueError, match="sinks"):
        ring_attention(q, k, k, [[(0, 8)]], None, scale=1.0, sinks=torch.zeros(2))


def test_merge_of_key_blocks_equals_full_softmax():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)
    full, full_lse = block_forward(q, k, v, kind="full", scale=0.5)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:3], -torch.inf)
    merge_block(out[:, :, 2:], lse[:, :, 2:], torch.zeros(1, 2, 3, 4), torch.full((1, 2, 3), -torch.inf))
    assert not out.isnan().any() and (lse == -torch.inf).all()  # rows without a visible key yet stay NaN-free
    for part in (slice(0, 4), slice(4, 9)):
        merge_block(out, lse, *block_forward(q, k[:, :, part], v[:, :, part], kind="full", scale=0.5))
    assert rel_err(out, full) < 1e-6 and rel_err(lse, full_lse) < 1e-6


def test_autocast_casts_like_sdpa():
    """Under bf16 autocast, q/k in fp32 (after rotary embeddings) and v in bf16 are cast as autocast casts sdpa."""
    torch.manual_seed(2)
    q, k = torch.randn(1, 4, 16, 8, requires_grad=True), torch.randn(1, 2, 16, 8, requires_grad=True)
    v = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        got = ring_attention(q, k, v, [[(0, 16)]], None, scale=8**-0.5)
    assert got.dtype == want.dtype == torch.bfloat16
    assert rel_err(got.float(), want.float()) < 1e-2
    got.float().sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)


def test_kernels_without_lse_are_refused():
    for name in ("flex_attention", "my_registered_kernel", "flash_attention_2", "varlen"):
        with pytest.raises(ValueError, match="log-sum-exp|CUDA"):
            check_kernel(name, "cpu")
    qkv = [torch.randn(1, 2, 8, 4) for _ in range(3)]
    with pytest.raises(ValueError, match="log-sum-exp"):
        ring_attention(*qkv, [[(0, 8)]], None, scale=1.0, kernel="flex_attention")
    with pytest.raises(ValueError, match="dropout"):
        ring_attention(*qkv, [[(0, 8)]], None, scale=1.0, dropout=0.1)


def test_varlen_gqa_fallback_repeats_kv_heads_and_sums_their_gradients(monkeypatch):
    """torch < 2.13's ``varlen_attn`` has no ``enable_gqa``: k / v are repeated to the q heads (query head ``h`` reads
    kv head ``h // group``) and the gradients of the copies are summed back. Checked against autograd of the repeat."""
    from hf_sp_trainer.attention import block_attention as ba

    monkeypatch.setattr(ba, "_varlen_takes_gqa", lambda: False)
    q, k = torch.randn(5, 6, 4), torch.randn(5, 2, 4, requires_grad=True)
    (wide,) = ba._gqa_expanded(q, k)
    assert wide.shape == (5, 6, 4) and torch.equal(wide[:, 4], k[:, 1]) and torch.equal(wide[:, 2], k[:, 0])
    grad = torch.randn_like(wide)
    wide.backward(grad)
    assert torch.equal(ba._gqa_reduced(grad, 2), k.grad)
    monkeypatch.setattr(ba, "_varlen_takes_gqa", lambda: True)
    assert ba._gqa_expanded(q, k)[0] is k  # the installed kernel takes GQA itself


# -- the ring over spawned gloo processes -------------------------------------------------------------------------
def _lengths(*lengths: int) -> list[tuple[int, int]]:
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    assert bounds[-1] == S
    return list(zip(bounds, bounds[1:], strict=False))


STRADDLE = _lengths(5, *[6] * 7, 1)  # a document across every chunk boundary (chunks of 6 and 12)
MIXED = _lengths(1, 1, 20, 3, 1, 22)
ONE_TOKEN = _lengths(*[1] * 5, 10, *[1] * 3, 30)
IMAGES_MIXED = ((0, 3, 21), (0, 21, 24), (0, 40, 48))  # MIXED's documents start at 0, 1, 2, 22, 25, 26


@dataclass(frozen=True)
class RingCase:
    segments: list  # per row
    hkv: int = 4
    window: int | None = None
    softcap: float | None = None
    kernel: str = "sdpa"
    dtype: torch.dtype = torch.float32
    tol: float = EXACT
    sinks: bool = False  # large per-head sinks (std 3 around the row LSE): dropping them fails
    dv: int = 8  # value head dim (MLA: != the q/k head dim 8)
    images: tuple = ()  # (row, start, end) runs whose tokens see each other (Gemma3)


CASES = {
    "one_doc": RingCase([[(0, S)]]),
    "one_doc_fp64": RingCase([[(0, S)]], dtype=torch.float64, tol=FP64_EXACT),
    "straddle": RingCase([STRADDLE]),
    "straddle_fp64": RingCase([STRADDLE], dtype=torch.float64, tol=FP64_EXACT),
    "mixed": RingCase([MIXED]),
    "one_token_docs": RingCase([ONE_TOKEN]),
    "window_lt_chunk": RingCase([_lengths(30, 18)], window=3),
    "window_gt_chunk": RingCase([MIXED], window=20),
    "window_fp64": RingCase([STRADDLE], window=7, dtype=torch.float64, tol=FP64_EXACT),
    "gqa_hkv1": RingCase([MIXED], hkv=1),
    "gqa_hkv2_window": RingCase([STRADDLE], hkv=2, window=9),
    "softcap": RingCase([MIXED], softcap=5.0),
    "softcap_gqa_window": RingCase([STRADDLE], hkv=2, window=5, softcap=5.0),
    "batch2": RingCase([MIXED, ONE_TOKEN]),
    "eager_window": RingCase([MIXED, STRADDLE], hkv=2, window=7, kernel="eager"),
    "bf16": RingCase([MIXED], hkv=2, dtype=torch.bfloat16, tol=BF16_TOL),
    "sinks": RingCase([STRADDLE], sinks=True),
    "sinks_gqa_window": RingCase([MIXED, STRADDLE], hkv=2, window=7, sinks=True),
    "sinks_eager_window_fp64": RingCase(
        [STRADDLE], hkv=1, window=9, kernel="eager", sinks=True, dtype=torch.float64, tol=FP64_EXACT
    ),  # fmt: skip
    "mla_dv6": RingCase([MIXED], hkv=2, dv=6),
    "mla_dv12_window_eager": RingCase([STRADDLE], window=7, kernel="eager", dv=12),
    "mla_sinks_window": RingCase([MIXED], hkv=2, window=9, sinks=True, dv=6),
    # Gemma3's images: one across three chunks (R = 4), one cut by a document start, one closing a row
    "images": RingCase([MIXED], images=IMAGES_MIXED),
    "images_window_gqa": RingCase([MIXED], hkv=2, window=5, images=IMAGES_MIXED),
    "images_fp64": RingCase(
        [STRADDLE], dtype=torch.float64, tol=FP64_EXACT, window=4, images=((0, 3, 16), (0, 30, 47))
    ),
    "images_batch2_eager": RingCase(
        [MIXED, STRADDLE], hkv=1, window=7, kernel="eager", images=(*IMAGES_MIXED, (1, 0, 9), (1, 12, 40))
    ),  # fmt: skip
}
RINGS = (1, 2, 4)


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    from hf_sp_trainer.comm import all_gather_along

    return x if group is None else all_gather_along(x, dim, group)


def _check_case(case: RingCase, group, seed: int) -> dict[str, float]:
    """Ring forward/backward of this rank's zigzag portion vs dense float64 attention of the whole sequence."""
    import torch.distributed as dist

    ring = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    torch.manual_seed(seed)  # every rank draws the same full tensors
    b, hq, d = len(case.segments), 4, 8
    q = torch.randn(b, hq, S, d) * (3.0 if case.softcap else 1.0)
    k, v = torch.randn(b, case.hkv, S, d), torch.randn(b, case.hkv, S, case.dv)
    dout = torch.randn(b, S, hq, case.dv)
    sinks = torch.randn(hq, dtype=case.dtype) * 3 + 2 if case.sinks else None  # row LSEs here are ~2-4
    perm, inv = zigzag_permutation(S, ring), zigzag_inverse_permutation(S, ring)
    mine = perm[rank * (S // ring) : (rank + 1) * (S // ring)]
    local = [t[:, :, mine].to(case.dtype).requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_() if case.sinks else None
    kw = dict(scale=d**-0.5, sliding_window=case.window, softcap=case.softcap, kernel=case.kernel, sinks=local_sinks)
    blocks = torch.tensor(case.images, dtype=torch.long) if case.images else None
    out = ring_attention(*local, case.segments, group, **kw, image_blocks=blocks)
    assert out.dtype == case.dtype and out.shape == (b, S // ring, hq, case.dv)
    out.backward(dout[:, mine].to(case.dtype))
    got = [_gather(out.detach(), 1, group)[:, inv]] + [_gather(t.grad, 2, group)[:, :, inv] for t in local]
    full = [t.to(case.dtype).double().requires_grad_() for t in (q, k, v)]  # the values the ring was given
    mask = visibility(case.segments, S, case.window, case.images)
    if case.sinks:  # each rank's sink gradient covers its queries: their sum is the whole gradient
        got.append(_sum(local_sinks.grad, group))
        full.append(sinks.double().requires_grad_())
    ref = dense_attention(*full[:3], mask, d**-0.5, case.softcap, full[3] if case.sinks else None)
    ref_grads = torch.autograd.grad(ref, full, dout.to(case.dtype).double())
    names = ("out", "dq", "dk", "dv", "dsinks")
    errors = {name: rel_err(a, b) for name, a, b in zip(names, got, (ref, *ref_grads), strict=False)}
    if case.sinks:  # negative control: the same reference without the sinks is far from what the ring computed
        errors["control_no_sinks"] = rel_err(got[0], dense_attention(*full[:3], mask, d**-0.5, case.softcap))
    if case.images:  # negative control: the images' pairs p < j matter
        causal = visibility(case.segments, S, case.window)
        errors["control_no_images"] = rel_err(got[0], dense_attention(*full[:3], causal, d**-0.5, case.softcap))
    return errors


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    if group is not None:
        x = x.clone()
        dist.all_reduce(x, group=group)
    return x


def _ring_worker() -> dict:
    """One spawned rank of a world of 4: every case on a ring of 4 (the world), of 2 (strided subgroups {0, 2} and
    {1, 3}: ring peers are not neighbouring global ranks) and of 1."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    halves = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = {4: dist.group.WORLD, 2: halves[rank % 2], 1: None}
    refused = []
    qkv = [torch.randn(1, 4, S // 4, 8) for _ in range(3)]
    for kernel in ("flex_attention", "my_registered_kernel"):  # first: a stray message would break the cases below
        try:
            ring_attention(*qkv, [[(0, S)]], dist.group.WORLD, scale=1.0, kernel=kernel)
        except ValueError as exc:
            refused.append(str(exc))
    errors = {}
    for seed, (name, case) in enumerate(CASES.items()):
        for ring in RINGS:
            errors[name, ring] = _check_case(case, groups[ring], seed)
    return {"refused": refused, "errors": errors}


@pytest.fixture(scope="module")
def ring_results() -> list[dict]:
    return unwrap_results(run_distributed(4, _ring_worker, timeout=300))


@pytest.mark.dist
@pytest.mark.parametrize("ring", RINGS)
@pytest.mark.parametrize("name", list(CASES))
def test_ring_attention_matches_dense(ring_results, name, ring):
    for rank, result in enumerate(ring_results):
        errors = dict(result["errors"][name, ring])
        control = errors.pop("control_no_sinks", None)
        images = errors.pop("control_no_images", None)
        assert max(errors.values()) <= CASES[name].tol, f"rank {rank}: {errors}"
        if CASES[name].sinks:
            assert control > 1e-2, f"rank {rank}: the sinks barely change the output ({control:.1e}): a weak test"
        if CASES[name].images:
            assert images > 1e-2, f"rank {rank}: the image pairs barely change the output ({images:.1e})"
        assert ("dsinks" in errors) == CASES[name].sinks


@pytest.mark.dist
def test_kernel_without_lse_refused_on_every_rank_before_communicating(ring_results):
    for result in ring_results:
        assert len(result["refused"]) == 2 and all("log-sum-exp" in msg for msg in result["refused"])
