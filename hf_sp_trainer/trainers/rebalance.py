"""Balanced data parallelism for packed rows: ``train_sampling_strategy="batch_rebalance"`` under SP (or with rows
packed by ``SPDataCollator`` at ``sp_size=1``).

With packing, rows differ in attention work, not in padding: a row of one 32K-token document costs far more than a row
of sixteen 2K-token ones, and with ``dp > 1`` the slowest data-parallel group sets every step. transformers'
``BatchRebalanceSampler`` fixes the *set* of examples of each optimizer step (a seeded permutation, the same on every
rank) and balances it over the ``dp x grad_accum`` micro-batches of the step, by a cost made for padded batches
(``bs x longest``). Under SP its ranks would be the whole world, so the ranks of one SP group would load different
rows; ``DocumentRebalanceSampler`` is the same sampler over the DP ranks of the SP topology, with the cost of a
padding-free packed row: the sum over its documents of their training FLOPs (``throughput.training_flops``: linear in
a document's tokens, quadratic in its causal pairs).

Exactness: the examples of each optimizer step are upstream's (its permutation and tail, untouched), so a step's loss,
a token-weighted sum over the step (``losses.sequence``), and its gradients are those of one process; only which
micro-batch holds which example changes. By default no row gets more tokens than the largest row the step's examples
would make in upstream's order, so balancing never needs more memory than not balancing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers.trainer_pt_utils import BatchRebalanceSampler

from ..integrations.throughput import attention_geometry, matmul_params, training_flops
from ..model.decoder import unwrap_peft


def example_documents(example: dict[str, Any]) -> list[int]:
    """Token counts of the documents packed in ``example``: TRL's ``seq_lengths``, else the runs of ``position_ids``
    that count up by one (``SPDataCollator``'s rule), else the whole example."""
    if example.get("seq_lengths") is not None:
        return [int(n) for n in example["seq_lengths"]]
    ids = example["input_ids"]
    positions = example.get("position_ids")
    if positions is None:
        return [len(ids)]
    positions = positions.tolist() if hasattr(positions, "tolist") else list(positions)
    starts = [t for t, p in enumerate(positions) if t == 0 or p != positions[t - 1] + 1]
    return [end - start for start, end in zip(starts, [*starts[1:], len(positions)], strict=True)]


def dataset_documents(dataset: Any) -> list[list[int]]:
    """``example_documents`` of every example; a ``datasets.Dataset`` is read a column at a time."""
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return [example_documents(dataset[i]) for i in range(len(dataset))]
    key = next((k for k in ("seq_lengths", "position_ids") if k in columns), "input_ids")
    if key == "input_ids":
        return [[len(ids)] for ids in dataset["input_ids"]]
    return [example_documents({"input_ids": (), key: value}) for value in dataset[key]]


def document_flops(model: Any) -> Callable[[int], float]:
    """The training FLOPs of one document of ``n`` tokens for ``model`` (``throughput.training_flops``, the MFU
    figure's model): its weights' ``(4 params + 2 trainable) n``, its attention's ``12 layers width n (n + 1) / 2``."""
    base = unwrap_peft(model)
    weights = matmul_params(base)
    geometry = attention_geometry(base.config.get_text_config())
    return lambda n: training_flops(n, n * (n + 1) / 2, *weights, *geometry)


class DocumentRebalanceSampler(BatchRebalanceSampler):
    """``BatchRebalanceSampler`` over the DP ranks of an SP topology, for rows packed without padding.

    Each optimizer step's examples (upstream's) are split into ``dp_size x grad_accum`` groups by longest-processing-
    time first: examples by cost, descending, each to the cheapest group with room for its tokens (``token_cap``:
    the most tokens a group of upstream's order would hold; when no group has room, the step keeps upstream's order
    of groups). The groups are dealt by cost, descending, ``dp_size`` per micro-step, alternating direction, so each
    micro-step and each rank's total are balanced. Every rank of an SP group yields its DP rank's groups.
    """

    def __init__(
        self,
        documents: Sequence[Sequence[int]],
        cost: Callable[[int], float],
        effective_batch_size: int,
        dp_size: int,
        grad_accum: int,
        dp_rank: int,
        drop_last: bool = False,
        token_cap: bool = True,
        shuffle: bool = True,
        seed: int = 42,
    ):
        super().__init__(
            lengths=[sum(docs) for docs in documents],
            effective_batch_size=effective_batch_size,
            dp_size=dp_size,
            grad_accum=grad_accum,
            shuffle=shuffle,
            seed=seed,
            rank=dp_rank,
            drop_last=drop_last,
        )
        self.costs = [sum(cost(n) for n in docs) for docs in documents]
        self.token_cap = token_cap

    def _assign(self, indices: list[int], lengths: list[int]) -> list[list[list[int]]]:
        """``[rank][micro-step] -> example indices`` for one optimizer step's ``indices`` (upstream's hook)."""
        slots = self.balanced_micro_batches(indices)
        per_rank: list[list[list[int]]] = [[] for _ in range(self.dp_size)]
        totals = [0.0] * self.dp_size
        for groups in slots:  # the micro-step's heaviest group to the rank with the least work so far
            ranks = sorted(range(self.dp_size), key=lambda r: (totals[r], r))
            for rank, group in zip(ranks, sorted(groups, key=self._group_total, reverse=True), strict=True):
                per_rank[rank].append(group)
                totals[rank] += self._group_total(group)
        return per_rank

    def balanced_micro_batches(self, indices: list[int]) -> list[list[list[int]]]:
        """``[micro-step][dp_size groups]`` of the step's ``indices`` (which may repeat an example: upstream's padded
        tail), each group in the step's own order.

        Micro-step by micro-step, the largest example left sets the micro-step's level (at least an even share of
        what is left); its ``dp_size`` groups are filled by longest-processing-time first up to that level, each
        with one example at least and ``dp_size`` examples kept for every later micro-step; the last takes the rest.
        """
        dp, count = self.dp_size, self.dp_size * self.grad_accum
        plain = _split_evenly(indices, count)
        drawn = [plain[s * dp : (s + 1) * dp] for s in range(self.grad_accum)]  # the fallback: upstream's grouping
        cap = max(sum(self.lengths[i] for i in group) for group in plain) if self.token_cap else float("inf")
        left = sorted(range(len(indices)), key=lambda p: (-self.costs[indices[p]], p))  # positions, costly first
        slots = []
        for slot in range(self.grad_accum):
            later = self.grad_accum - slot - 1
            level = max(self.costs[indices[left[0]]], sum(self.costs[indices[p]] for p in left) / (later + 1) / dp)
            groups: list[list[int]] = [[] for _ in range(dp)]
            cost, tokens = [0.0] * dp, [0] * dp
            for position in list(left):
                if later and len(left) <= dp * later:
                    break  # the rest is kept for the later micro-steps
                example = indices[position]
                room = [g for g in range(dp) if tokens[g] + self.lengths[example] <= cap]
                room = [g for g in room if not groups[g]] or room  # every group gets an example first
                g = min(room, key=lambda g: (cost[g], g), default=None)
                if g is None or (later and groups[g] and cost[g] + self.costs[example] > level):
                    if not later:
                        return drawn  # no fit under the cap
                    continue
                groups[g].append(position)
                cost[g] += self.costs[example]
                tokens[g] += self.lengths[example]
                left.remove(position)
            if not all(groups):
                return drawn
            slots.append([[indices[p] for p in sorted(group)] for group in groups])
        return slots

    def _group_total(self, group: list[int]) -> float:
        return sum(self.costs[i] for i in group)


def _split_evenly(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` consecutive groups whose sizes differ by at most one (the first ones larger)."""
    base, extra = divmod(len(items), parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (part < extra))
    return [items[bounds[p] : bounds[p + 1]] for p in range(parts)]


def rebalanced(trainer: Any, upstream: BatchRebalanceSampler, dataset: Any) -> DocumentRebalanceSampler:
    """The replacement of the ``upstream`` sampler the base trainer built for ``dataset``: the same step size, tail and
    seed; the DP ranks of the SP topology (all ranks without SP); packed rows' cost."""
    args = trainer.args
    topology = trainer.sp.topology if trainer.sp is not None else None
    dp_size, dp_rank = (topology.dp_size, topology.dp_rank) if topology else (args.world_size, args.process_index)
    return DocumentRebalanceSampler(
        documents=dataset_documents(dataset),
        cost=document_flops(trainer.model),
        effective_batch_size=args.train_batch_size * args.gradient_accumulation_steps * dp_size,
        dp_size=dp_size,
        grad_accum=args.gradient_accumulation_steps,
        dp_rank=dp_rank,
        drop_last=upstream.drop_last,
        shuffle=upstream.shuffle,
        seed=upstream.seed,
    )


__all__ = ["DocumentRebalanceSampler", "dataset_documents", "document_flops", "example_documents", "rebalanced"]
