"""The swapped entries of the top-k sparse attentions (``mixers.swap``'s ``MODULE_ENTRIES``): DeepSeek sparse attention
(``attention/dsa.py``), MiniMax-M3's block-sparse attention (``attention/block_sparse.py``), Qwen4-Exp's
query-sparse attention (``attention/qsa.py``) and Doge's dynamic-mask attention (``attention/doge.py``).

Each runs transformers' own forward outside an SP forward, the SP version inside one, and raises inside one when SP's
document bounds did not reach it (``documents.refuse_without_documents``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..attention.block_sparse import m3_projection, sp_block_topk
from ..attention.deepseek_v4 import v4_attention_forward
from ..attention.doge import doge_attention_forward
from ..attention.dsa import INDICES_KWARG, POSITIONAL_PROJECTIONS, PROJECTIONS, placeholder_mask, sp_index_topk
from ..attention.pooled_dsa import glm5_next_attention_forward, pooled_projection, sp_pooled_topk
from ..attention.qsa import qsa_projection, sp_qsa_select
from ..documents import (
    BOUNDS_KWARG,
    SP_KWARG,
    current_scope,
    refuse_without_documents,
    run_in_scope,
    scoped_sp_kwargs,
)
from ..sharding import SequenceSharding


def _sp_documents(kwargs: dict):
    """``(bounds, mixer context)`` SP's kwargs hand the caller (in ``kwargs``, else the scope); ``None`` for either
    that is missing."""
    bounds, ctx = kwargs.get(BOUNDS_KWARG), (kwargs.get(SP_KWARG) or {}).get("mixers")
    if bounds is None:
        scoped = scoped_sp_kwargs()
        bounds, ctx = scoped.get(BOUNDS_KWARG), (scoped.get(SP_KWARG) or {}).get("mixers")
    return bounds, ctx


def selection_sp(kwargs: dict, module: str):
    """``(bounds, topology)`` of the SP forward running the caller (SP's kwargs in ``kwargs``, else the scope);
    ``None`` outside one and at sp_size 1; inside an SP forward without them, ``module`` raises."""
    bounds, ctx = _sp_documents(kwargs)
    if bounds is None or ctx is None:
        refuse_without_documents(module)
        return None
    return (bounds, ctx.topology) if ctx.topology is not None else None


def refuse_packed_rows_at_sp1(module: str, rows: int, why: str) -> None:
    """At sp_size 1 (documents kept apart in one process: SP's kwargs present, no topology), raise when a row holds
    more than one document: ``module``'s installed selection (run there) would not compute each as alone (``why``)."""
    bounds, ctx = _sp_documents({})
    if bounds is None or ctx is None or ctx.topology is not None:
        return
    seq = int(bounds[-1]) // rows
    if any(int(start) % seq for start in bounds[:-1]):
        raise ValueError(
            f"{module} at sp_size=1 got rows packed from several documents: {why}, so they would not train as "
            "each document alone. Use sp_size >= 2 (exact), or one document per row (no padding-free packing)."
        )


def refuse_cache_and_dropout(module, cache, dropout: bool = False) -> None:
    """What an SP selecting attention can't run: a cache (cached decoding), and, where ``dropout``, attention dropout
    in training (its tiles are recomputed in the backward). Raised on every rank alike, before any collective."""
    if cache is not None:
        raise ValueError(f"{type(module).__name__} under sequence parallelism runs without a cache.")
    if dropout and module.training and module.attention_dropout:
        raise ValueError(
            f"{type(module).__name__} under sequence parallelism has no attention dropout: set attention_dropout=0."
        )


def ring_sharding(topology) -> dict:
    """``{"sharding": the zigzag sharding}`` for a selection's keywords with a ring (``topology.ring_size > 1``),
    ``{}`` without one (contiguous shards)."""
    if topology.ring_size == 1:
        return {}
    return {"sharding": SequenceSharding(topology.sp_size, topology.ring_size)}


def whole_sequence_selection(module, sp: tuple, cache, project: Callable, select: Callable) -> torch.Tensor:
    """An indexer's selection under SP (``sp``: ``selection_sp``'s bounds and topology): its projection of this
    rank's tokens (``project()``, no autograd), then ``select`` over the whole sequence gathered across the group;
    with a ring, given the zigzag ``sharding`` of the tokens (the selections that take one; validate refuses a ring
    for the others). Without a cache (SP refuses cached decoding)."""
    refuse_cache_and_dropout(module, cache)
    bounds, topology = sp
    with torch.no_grad():
        projected = project()
    return select(module, projected, bounds, topology.sp_group, topology.sp_rank, **ring_sharding(topology))


def dsa_attention_entry(original: Callable) -> Callable:
    """A DSA attention (``DeepseekV32Attention``): under SP its installed forward, given a placeholder for the mask
    it slices for its indexer and SP's kwargs as the scope its indexer (called without them) reads."""

    @functools.wraps(original)
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        sp = selection_sp(kwargs, type(self).__name__)
        if sp is not None:
            refuse_cache_and_dropout(self, cache)
            seq = hidden_states.shape[1] * sp[1].sp_size
            attention_mask = placeholder_mask(hidden_states, seq)
            scope = (*current_scope(), {k: kwargs[k] for k in (BOUNDS_KWARG, SP_KWARG)})
            return run_in_scope(
                scope, original, self, hidden_states=hidden_states, position_embeddings=position_embeddings,
                attention_mask=attention_mask, cache=cache, **kwargs,
            )  # fmt: skip
        return original(
            self, hidden_states=hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
            cache=cache, **kwargs,
        )  # fmt: skip

    return forward


def dsa_indexer_entry(original: Callable) -> Callable:
    """A DSA indexer (``DeepseekV32Indexer``), called without SP's kwargs: under SP (the scope its attention set)
    the whole sequence's top-k (``attention.dsa.sp_index_topk``); transformers' own otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None):
        sp = selection_sp({}, type(self).__name__)
        if sp is None:
            return original(
                self, hidden_states=hidden_states, q_resid=q_resid, position_embeddings=position_embeddings,
                attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            )  # fmt: skip
        project = functools.partial(PROJECTIONS[type(self).__name__], self, hidden_states, q_resid, position_embeddings)
        return whole_sequence_selection(self, sp, cache, project, sp_index_topk)

    return forward


def positional_indexer_entry(original: Callable) -> Callable:
    """A DSA indexer called with ``position_ids`` and no ``q_resid`` (``MistralLarge4TextIndexer``: its query scaling
    reads each token's document position): under SP the whole sequence's top-k (``attention.dsa.sp_index_topk``)
    from ``POSITIONAL_PROJECTIONS``; transformers' own otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, position_embeddings, attention_mask, position_ids, cache=None):
        sp = selection_sp({}, type(self).__name__)
        if sp is None:
            return original(
                self, hidden_states=hidden_states, position_embeddings=position_embeddings,
                attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            )  # fmt: skip
        project = POSITIONAL_PROJECTIONS[type(self).__name__]
        project = functools.partial(project, self, hidden_states, position_embeddings, position_ids)
        return whole_sequence_selection(self, sp, cache, project, sp_index_topk)

    return forward


M3_ROW_SLOTS = "transformers' block selection anchors its key blocks at the row's slots, not at each document's start"
POOLS_FROM_ROW_START = "transformers' pooled indexer counts its pools from the row's first token, not each document's"


def pooled_attention_entry(original: Callable) -> Callable:
    """GLM-5-Next's attention (``Glm5NextTextAttention``): under SP ``attention.pooled_dsa.glm5_next_attention_forward``
    (its top-k handed to SP's attention as ``indices=``, where transformers builds a dense mask of the rank's own
    keys), with SP's kwargs as the scope its indexer reads; transformers' own otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, attention_mask, cache=None, prev_topk_indices=None, **kwargs):
        sp = selection_sp(kwargs, type(self).__name__)
        if sp is None:
            return original(
                self, hidden_states=hidden_states, attention_mask=attention_mask, cache=cache,
                prev_topk_indices=prev_topk_indices, **kwargs,
            )  # fmt: skip
        scope = (*current_scope(), {k: kwargs[k] for k in (BOUNDS_KWARG, SP_KWARG)})
        return run_in_scope(
            scope, glm5_next_attention_forward, self, hidden_states, attention_mask=attention_mask, cache=cache,
            prev_topk_indices=prev_topk_indices, **kwargs,
        )  # fmt: skip

    return forward


def pooled_indexer_entry(original: Callable) -> Callable:
    """GLM-5-Next's pooled indexer (``Glm5NextTextIndexer``), called without SP's kwargs: under SP (the scope its
    attention set) the whole sequence's pooled top-k, pools counted from each document's start
    (``attention.pooled_dsa.sp_pooled_topk``); transformers' own otherwise (at sp_size 1 only on rows of one
    document)."""

    @functools.wraps(original)
    def forward(self, hidden_states, q_resid, attention_mask, cache=None):
        sp = selection_sp({}, type(self).__name__)
        if sp is None:
            refuse_packed_rows_at_sp1(type(self).__name__, hidden_states.shape[0], POOLS_FROM_ROW_START)
            return original(
                self, hidden_states=hidden_states, q_resid=q_resid, attention_mask=attention_mask, cache=cache
            )
        project = functools.partial(pooled_projection, self, hidden_states, q_resid)
        return whole_sequence_selection(self, sp, cache, project, sp_pooled_topk)

    return forward


def block_indexer_entry(original: Callable) -> Callable:
    """MiniMax-M3's indexer (``MiniMaxM3VLIndexer``), called by its attention without SP's kwargs (the decoder's
    scope has them): under SP the whole sequence's block top-k (``attention.block_sparse.sp_block_topk``), which the
    installed attention hands to SP's as ``block_indices``; transformers' own otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, position_embeddings, cache=None, position_ids=None):
        sp = selection_sp({}, type(self).__name__)
        if sp is None:
            refuse_packed_rows_at_sp1(type(self).__name__, hidden_states.shape[0], M3_ROW_SLOTS)
            return original(
                self, hidden_states=hidden_states, position_embeddings=position_embeddings, cache=cache,
                position_ids=position_ids,
            )  # fmt: skip
        project = functools.partial(m3_projection, self, hidden_states, position_embeddings)
        return whole_sequence_selection(self, sp, cache, project, sp_block_topk)

    return forward


def installed_outside_sp(original: Callable, sp_forward: Callable) -> Callable:
    """An attention entry with the ``(hidden_states, position_embeddings, attention_mask, cache, **kwargs)`` forward:
    ``sp_forward(self, sp, hidden_states, position_embeddings, cache, kwargs)`` under SP (``sp``: ``selection_sp``'s
    bounds and topology), the installed forward otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        sp = selection_sp(kwargs, type(self).__name__)
        if sp is None:
            return original(
                self, hidden_states=hidden_states, position_embeddings=position_embeddings,
                attention_mask=attention_mask, cache=cache, **kwargs,
            )  # fmt: skip
        return sp_forward(self, sp, hidden_states, position_embeddings, cache, kwargs)

    return forward


def qsa_attention_entry(original: Callable) -> Callable:
    """Qwen4-Exp's sparse attention (``Qwen4ExpTextAttention``): under SP it selects first (``attention.qsa``), then
    runs its installed forward with a one-element mask (its swapped indexer returns one) and the selection as
    ``indices=`` for SP's attention; transformers' own otherwise."""

    def sp_forward(self, sp, hidden_states, position_embeddings, cache, kwargs):
        refuse_cache_and_dropout(self, cache)
        (bounds, topology), indexer = sp, self.indexer
        with torch.no_grad():
            projected = qsa_projection(indexer, hidden_states, position_embeddings)
            picks = sp_qsa_select(
                indexer, projected, position_embeddings, bounds, topology.sp_group, topology.sp_rank,
                **ring_sharding(topology),
            )  # fmt: skip
        one = torch.ones((), dtype=torch.bool, device=hidden_states.device)
        scope = (*current_scope(), {k: kwargs[k] for k in (BOUNDS_KWARG, SP_KWARG)})  # its indexer reads it
        return run_in_scope(
            scope, original, self, hidden_states=hidden_states, position_embeddings=position_embeddings,
            attention_mask=one, cache=None, **kwargs, **{INDICES_KWARG: picks},
        )  # fmt: skip

    return installed_outside_sp(original, sp_forward)


def qsa_indexer_entry(original: Callable) -> Callable:
    """Qwen4-Exp's indexer (``Qwen4ExpTextQSAIndexer``), called by its attention: under SP a one-element mask (its
    attention selected already, ``qsa_attention_entry``); transformers' own otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):  # kwargs: >= 5.25
        if selection_sp(kwargs, type(self).__name__) is None:
            return original(
                self, hidden_states=hidden_states, position_embeddings=position_embeddings,
                attention_mask=attention_mask, cache=cache, **kwargs,
            )  # fmt: skip
        return torch.ones((), dtype=torch.bool, device=hidden_states.device)

    return forward


def v4_attention_entry(original: Callable) -> Callable:
    """DeepSeek-V4's attention (``DeepseekV4Attention``): wherever SP's documents reach it, ``attention.deepseek_v4``'s
    forward (its window, its document's compressed entries, the indexer's picks), at sp_size 1 too (documents kept
    apart in one process: transformers' own aligns the windows to the row); transformers' own otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, position_embeddings, position_ids, attention_mask=None, cache=None, **kwargs):
        bounds, ctx = _sp_documents(kwargs)
        if bounds is None or ctx is None:
            refuse_without_documents(type(self).__name__)
            return original(
                self, hidden_states=hidden_states, position_embeddings=position_embeddings, position_ids=position_ids,
                attention_mask=attention_mask, cache=cache, **kwargs,
            )  # fmt: skip
        refuse_cache_and_dropout(self, cache, dropout=True)
        group, rank = (None, 0) if ctx.topology is None else (ctx.topology.sp_group, ctx.topology.sp_rank)
        out = v4_attention_forward(self, hidden_states, position_embeddings, position_ids, bounds, group, rank)
        return out, None

    return forward


def doge_attention_entry(original: Callable) -> Callable:
    """Doge's attention (``DogeAttention``): under SP ``attention.doge.doge_attention_forward`` (its dynamic mask's
    top-k over each document's visible keys, where transformers builds it over its row's mask); transformers' own
    otherwise."""

    def sp_forward(self, sp, hidden_states, position_embeddings, cache, kwargs):
        refuse_cache_and_dropout(self, cache, dropout=True)
        bounds, topology = sp
        ring = None
        if topology.ring_size > 1:  # the ring group's keys gathered (DSA's all-gather path)
            order = ring_sharding(topology)["sharding"].order(hidden_states.shape[1] * topology.sp_size)
            ring = (topology.ring_group, topology.ring_rank, order)
        out = doge_attention_forward(self, hidden_states, position_embeddings, bounds, topology.ulysses_group, ring)
        return out, None

    return installed_outside_sp(original, sp_forward)
