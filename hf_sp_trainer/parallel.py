"""``apply_sequence_parallel``: sequence parallelism as one function applied to a plain model.

The trainers, the benchmarks and the tests all go through it::

    sp = apply_sequence_parallel(model, sp_size=4)           # attaches the attention, builds the groups
    shard = sp.shard_batch(batch)                            # this rank's slice of a batch every SP rank holds
    logits = sp.gather_sequence(model(**shard).logits)       # back to the whole sequence, original order
    sp.remove()                                              # detached, groups destroyed (or: with ... as sp:)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from .attention.ulysses import VARLEN_KEY, UlyssesAttention
from .comm import all_gather_along
from .losses.router import RouterLoss, sp_router_loss
from .mixers.swap import attach_mixers, check_mixer_kernels, check_state_passing
from .model.decoder import decoder_layers
from .model.heads import attention_shapes, head_counts
from .model.vlm import is_multimodal
from .multimodal.features import MediaFeatures
from .sharding import SequenceSharding
from .topology import SPTopology, release_groups, sp_topology
from .topology.teardown import register_exit_hook
from .validate import validate_model_for_sp

logger = logging.get_logger(__name__)


@dataclass
class SequenceParallel:
    """What batch preparation and evaluation need from an SP model: its groups, its sharding and its attention."""

    model: PreTrainedModel
    topology: SPTopology
    sharding: SequenceSharding
    attention: UlyssesAttention
    router_loss: RouterLoss | None = None  # MoE models: the load-balancing loss as shares of the whole sequence's
    media: MediaFeatures | None = None  # VLMs: each rank's placeholder rows of the encoded images / videos

    def shard_batch(self, batch: dict[str, Any], pad_token_id: int = 0) -> dict[str, Any]:
        """The full batch (the same on every rank of the SP group) -> this rank's shard, for ``model(**shard)``."""
        return self.sharding.shard_batch(batch, self.topology.sp_rank, pad_token_id)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Per-rank ``[b, s/P, ...]`` -> ``[b, s, ...]`` in the original token order (padded length; no autograd)."""
        return self.sharding.unshard(all_gather_along(x, 1, self.topology.sp_group))

    def detach(self) -> None:
        """Detach SP from the model (its attention is the inner kernel again, on the local tokens); the SP process
        groups stay, e.g. to evaluate the same model without SP and attach it again."""
        self.attention.detach(self.model)
        if self.router_loss is not None:
            self.router_loss.detach()
        if self.media is not None:
            self.media.detach()

    def remove(self) -> None:
        """End SP in this process: detach it from the model and destroy its process groups (every rank calls it,
        before ``dist.destroy_process_group()``); also what leaving ``with apply_sequence_parallel(...) as sp:`` does.
        """
        self.detach()
        release_groups()

    def __enter__(self) -> SequenceParallel:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor", mode: str | None = None) -> int:
    """``torch.compile`` every decoder layer in place (regional compilation), with dynamic shapes.

    The SP attention inside is one dispatcher op per call (the all-to-alls and the block kernels), so a layer
    compiles without graph breaks, and the document layout reaches it as a tensor argument: one graph serves every
    layer and every sequence length. What runs once per forward (gathering ``position_ids``, planning the
    documents) stays outside, in the decoder's pre-hook. Returns the number of layers compiled.
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, mode=mode, dynamic=True)
    return len(layers)


def default_kernel(model: PreTrainedModel) -> str:
    """The model's own attention, except sdpa on CUDA: torch's varlen kernel, one call per layer for all documents."""
    kernel = model.config._attn_implementation
    return VARLEN_KEY if kernel == "sdpa" and torch.cuda.is_available() else kernel


def apply_sequence_parallel(
    model: PreTrainedModel,
    sp_size: int,
    *,
    ring_size: int | None = None,
    attn_implementation: str | None = None,
    state_passing: str = "gather",
    split_media: bool = False,
) -> SequenceParallel:
    """Split every sequence of ``model``'s inputs over ``sp_size`` ranks (``ulysses x ring``).

    ``ring_size`` defaults to the smallest ring that leaves a Ulysses degree dividing the query heads;
    ``attn_implementation`` is the kernel run inside (default: the model's own); ``state_passing`` how hybrid layers
    carry their recurrent state across the ranks ("gather", or "relay": a sequential debugging aid); ``split_media``
    whether a VLM's images / videos are split over the ranks, their features exchanged (``media_split.py``). Collective:
    every rank of the default process group calls it. Raises a ``ValueError`` on every rank, before any
    communication, for a model or split that can't work.
    """
    kernel = attn_implementation or default_kernel(model)
    ulysses, ring = validate_model_for_sp(model, sp_size, ring_size, kernel)
    check_mixer_kernels(model)
    check_state_passing(state_passing)
    register_exit_hook()  # a script that never calls remove() or destroys its groups still exits cleanly
    topology = sp_topology(sp_size, ring)
    sharding = SequenceSharding(sp_size, ring)
    attention = UlyssesAttention(topology, sharding, kernel)
    attention.attach(model)
    attach_mixers(model, attention.documents, state_passing)  # hybrid layers' convs and recurrences, exact
    router_loss = sp_router_loss(model, topology.sp_group)
    media = MediaFeatures(model, topology, sharding, split_media) if is_multimodal(model) else None
    if topology.rank == 0:
        logger.info(
            f"Sequence parallelism: sp_size={sp_size} = ulysses {ulysses} x ring {ring} for {_heads(model)}, kernel "
            f"{kernel!r}, {topology.dp_size} data-parallel group(s)."
        )
    return SequenceParallel(
        model=model, topology=topology, sharding=sharding, attention=attention, router_loss=router_loss, media=media
    )


def _heads(model: PreTrainedModel) -> str:
    if not attention_shapes(model.config):
        return "no attention heads (a state-space model: the sequence split only)"
    heads, kv_heads = head_counts(model.config)
    return f"{heads} query / {kv_heads} kv heads"
