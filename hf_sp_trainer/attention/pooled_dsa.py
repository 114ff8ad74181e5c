"""GLM-5-Next's pooled DeepSeek sparse attention (``Glm5NextTextIndexer``, ``Glm5NextTextAttention``) under SP,
exact (with a ring too: its selection gathered in sequence order, its keys by DSA's all-gather path).

Its indexer scores *pools* of ``index_kpool`` consecutive keys instead of single keys: a pool's key is a gated
average of its keys (a softmax over the pool's tokens, per channel, of a gate projection plus a learned offset per
slot), the pools start at the row's first real token, and only complete pools whose last token the query sees count.
Each query takes the ``index_topk / index_kpool`` best pools (as tokens) plus, with ``index_kpool_always_select_tail``,
the tokens of its own incomplete pool; ``-1`` pads the selection. transformers counts the pools from the row's start,
so on a packed row a pool would straddle two documents; SP counts them from each *document's* start (what one device
computes for each document alone), over the whole sequence's gathered keys and gates (``[b, seq, head_dim]`` each,
no autograd: the indexer runs under ``no_grad`` in transformers too).

Its attention builds a dense mask from the selection for eager / sdpa only; under SP it runs
``glm5_next_attention_forward`` instead: the same projections, its top-k handed to SP's attention as ``indices=``
(``attention.dsa.selected_attention``, which drops the ``-1`` padding). Both are behaviour-checked
(``mixers.pooled_dsa_checks``) against the installed classes on documents alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..sharding.sequence import SequenceSharding
from .dsa import INDICES_KWARG, SCORE_BYTES, gather_sequence, local_positions


def pooled_projection(indexer: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor):
    """``Glm5NextTextIndexer.forward``'s queries ``[b, s, H, D]`` (fp32), keys and gate scores ``[b, s, D]``, head
    weights ``[b, s, H]`` (fp32): no RoPE (the model has no positional embedding)."""
    b, s, _ = hidden_states.shape
    q = indexer.wq_b(q_resid).view(b, s, -1, indexer.head_dim)
    keys = indexer.k_norm(indexer.wk(hidden_states))
    gates = F.linear(hidden_states, indexer.index_kpool_compress_gate)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return q.float(), keys, gates, weights * indexer.n_heads**-0.5


def document_pools(starts: list[int], ends: list[int], size: int, device) -> torch.Tensor:
    """``[pools, size]``: the positions of every complete pool of ``size`` tokens, counted from each document's
    start (a document's incomplete last pool is not one)."""
    firsts = [torch.arange(a, a + (e - a) // size * size, size) for a, e in zip(starts, ends, strict=True)]
    first = torch.cat(firsts) if firsts else torch.zeros(0, dtype=torch.long)
    return (first[:, None] + torch.arange(size)).to(device)


def pool_keys(indexer: torch.nn.Module, keys: torch.Tensor, gates: torch.Tensor, pools: torch.Tensor) -> torch.Tensor:
    """``[pools, D]``: each pool's gated average of its keys (``keys`` / ``gates``: one row's ``[seq, D]``), as
    ``Glm5NextTextIndexer.get_pooled_states`` computes it."""
    logits = gates[pools].float() + indexer.index_kpool_compress_ape.float()[None]
    return (logits.softmax(dim=1).to(keys.dtype) * keys[pools]).sum(dim=1)


@torch.no_grad()
def sp_pooled_topk(
    indexer: torch.nn.Module,
    projected: tuple[torch.Tensor, ...],
    bounds: torch.Tensor,
    group: dist.ProcessGroup | None,
    rank: int,
    sharding: SequenceSharding | None = None,
) -> torch.Tensor:
    """``[b, seq, width]`` int32: for every query of the whole sequence (in sequence order), the whole-sequence
    positions of the tokens of its best visible pools and of its own incomplete pool, ``-1`` padded (``width`` as
    transformers': the top-k, plus ``index_kpool - 1`` with the tail). ``projected``: SP rank ``rank``'s
    ``pooled_projection``, its shard of the ``sharding`` (a ring's zigzag one; ``None``: contiguous shards); keys,
    gates and the selections are gathered over ``group``."""
    q, keys, gates, weights = projected
    b, s, heads, _ = q.shape
    keys, gates = (gather_sequence(t.contiguous(), group, sharding) for t in (keys, gates))
    seq, size = keys.shape[1], indexer.index_kpool
    tail = size - 1 if indexer.index_kpool_always_select_tail else 0
    width = indexer.index_topk + tail
    flat = bounds.tolist()
    picks = torch.full((b, s, width), -1, dtype=torch.long, device=q.device)
    for row in range(b):
        pairs = zip(flat[:-1], flat[1:], strict=True)  # the documents of this row, from its first position
        docs = [(a - row * seq, e - row * seq) for a, e in pairs if row * seq <= a < (row + 1) * seq]
        starts, ends = [a for a, _ in docs], [e for _, e in docs]
        pools = document_pools(starts, ends, size, q.device)
        pooled = pool_keys(indexer, keys[row], gates[row], pools).float()  # [pools, D]
        doc_start = torch.as_tensor(starts, device=q.device)
        queries = local_positions(s, rank, sharding, q.device)
        first = doc_start[torch.searchsorted(doc_start, queries, right=True) - 1]  # each query's document start
        pool_first = pools[:, 0]
        select = min(indexer.index_topk // size, pools.shape[0])
        tile = max(1, SCORE_BYTES // (4 * heads * max(1, pools.shape[0])))
        for lo in range(0, s, tile):
            rows = slice(lo, min(s, lo + tile))
            scores = F.relu(torch.matmul(q[row, rows], pooled.T) * indexer.softmax_scale)  # [tile, H, pools]
            index = torch.matmul(weights[row, rows].unsqueeze(-2), scores).squeeze(-2)  # [tile, pools]
            visible = (pool_first >= first[rows, None]) & (pools[:, -1] <= queries[rows, None])
            if select:
                index = index.masked_fill(~visible, float("-inf"))
                best = index.topk(select, dim=-1)
                chosen = pools[best.indices].masked_fill(best.values.isneginf()[..., None], -1)  # [tile, select, K]
                picks[row, rows, : select * size] = chosen.flatten(-2)
            if tail:  # the query's own incomplete pool, up to itself
                seen = queries[rows] - first[rows] + 1
                offsets = torch.arange(tail, device=q.device)
                start = (queries[rows] + 1 - seen % size)[:, None] + offsets
                own = start.masked_fill(offsets >= (seen % size)[:, None], -1)
                picks[row, rows, indexer.index_topk :] = own
    return gather_sequence(picks.to(torch.int32), group, sharding)


def glm5_next_attention_forward(
    module: torch.nn.Module, hidden_states, attention_mask=None, cache=None, prev_topk_indices=None, **kwargs
):
    """``Glm5NextTextAttention.forward`` under SP: its projections as installed, its top-k (its indexer's, under SP
    ``sp_pooled_topk``; or the previous layer's) handed to the attention function as ``indices=`` in place of the
    dense mask it builds for eager / sdpa; returns its top-k where the next layer reuses it."""
    if cache is not None:
        raise ValueError(f"{type(module).__name__} under sequence parallelism runs without a cache.")
    b, s = hidden_states.shape[:-1]
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    query = module.q_b_proj(q_resid).view(b, s, -1, module.qk_head_dim).transpose(1, 2)
    latent = module.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_rot = torch.split(latent, [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    k_pass = module.kv_a_layernorm(kv_pass).view(b, 1, s, module.kv_lora_rank)
    key, value = module.expand_kv(k_pass, k_rot.view(b, 1, s, module.qk_rope_head_dim))
    if module.indexer is not None:
        topk = module.indexer(hidden_states=hidden_states, q_resid=q_resid, attention_mask=attention_mask, cache=None)
    elif prev_topk_indices is None:
        raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
    else:
        topk = prev_topk_indices
    attend = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
    dropout = module.attention_dropout if module.training else 0.0
    kwargs[INDICES_KWARG] = topk
    out, weights = attend(module, query, key, value, None, dropout=dropout, scaling=module.scaling, **kwargs)
    out = module.o_proj(out.reshape(b, s, -1).contiguous())
    return out, weights, topk if module.next_skip_topk else None


__all__ = ["glm5_next_attention_forward", "pooled_projection", "sp_pooled_topk"]
