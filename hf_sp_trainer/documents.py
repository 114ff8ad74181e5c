"""The documents of packed rows under sequence parallelism, found once per forward by one decoder pre-hook.

``DocumentLayout`` says where each document of a row begins and ends over the whole (gathered) sequence;
``document_bounds`` packs that into one tensor. ``DocumentHook``, a forward pre-hook on the decoder, computes both from
the ``position_ids`` of the whole rows (gathered over the SP group; at sp_size 1 the local rows) and passes down to
every layer the bounds (``BOUNDS_KWARG``) and, for hybrid models, the model's own mixer context (``SP_KWARG``), so
that the swapped kernels, shared by every model of a family, serve the model being run, not a process global. (The
attention needs no such kwarg: each model's is registered under a key of its own.) Where the model drops the
``position_ids`` it was called with (``Mamba2ForCausalLM``), the hook takes the model's own; where a layer calls its
attention without ``**kwargs`` (Nemotron, StableLM), ``relay_sp_kwargs`` carries SP's kwargs past it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from .comm import all_gather_along
from .model.decoder import forward_decoder
from .model.mixers import attention_without_kwargs
from .sharding import SequenceSharding, check_sp_padding
from .topology import SPTopology

BOUNDS_KWARG = "sp_document_bounds"  # the whole sequence's documents, passed by the decoder pre-hook to every layer
SP_KWARG = "sp_context"  # the SP context of the model being run (a dict; "mixers": its hybrid layers')
SP_KWARGS_PREFIX = "sp_"  # every kwarg SP passes down the layers (bounds, context, image blocks) starts with it
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> (its DocumentHook, the handles attached)
# The ``sp_*`` kwargs of the decoders being run, innermost last (``DocumentHook``): call-scoped, not a model's state
# (each entry is what its own model's decoder pre-hook passed down).
_SCOPE: ContextVar[tuple[dict[str, Any], ...]] = ContextVar("sp_scope", default=())
# The scope entry of a model's own forward around its decoder (``DocumentHook``): code the model runs outside its
# decoder (no documents passed down there) is still inside an SP forward, where a swapped kernel must not fall back.
_OUTSIDE_DECODER = "_sp_forward_outside_decoder"  # no ``sp_`` prefix: never passed down as a kwarg


@dataclass
class DocumentLayout:
    """Documents of each row of a packed batch, from its full-sequence ``position_ids``.

    A document starts wherever ``position_ids[t] != position_ids[t - 1] + 1`` (the rule of
    ``transformers.masking_utils.find_packed_sequence_indices``), so padding numbered from 0 forms a document of its
    own that no real token attends to.
    """

    position_ids: torch.Tensor  # [batch, seq]
    segments: list[list[tuple[int, int]]]  # per row: [(start, end), ...]
    _mask_cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> DocumentLayout:
        pos = position_ids.detach().to("cpu", torch.long)
        seq = pos.shape[1]
        starts_flag = torch.ones_like(pos, dtype=torch.bool)
        starts_flag[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        segments = []
        for row in starts_flag:
            starts = row.nonzero().flatten().tolist()
            segments.append(list(zip(starts, starts[1:] + [seq], strict=True)))
        return cls(position_ids=position_ids, segments=segments)

    def document_ids(self) -> torch.Tensor:
        """``[batch, seq]`` index of the document each token belongs to."""
        ids = torch.empty(self.position_ids.shape, dtype=torch.long)
        for r, row in enumerate(self.segments):
            for d, (start, end) in enumerate(row):
                ids[r, start:end] = d
        return ids.to(self.position_ids.device)

    def cu_seq_lens(self) -> tuple[torch.Tensor, int]:
        """Cumulative document lengths over the rows laid end to end (varlen kernels), and the longest document."""
        seq = self.position_ids.shape[1]
        bounds = [r * seq + s for r, row in enumerate(self.segments) for s, _ in row]
        bounds.append(len(self.segments) * seq)
        lengths = [e - s for row in self.segments for s, e in row]
        cu = torch.tensor(bounds, dtype=torch.int32, device=self.position_ids.device)
        return cu, max(lengths)

    def cached(self, key, build):
        """Build once per layout (i.e. once per forward step) what every layer would otherwise rebuild."""
        if key not in self._mask_cache:
            self._mask_cache[key] = build()
        return self._mask_cache[key]


def document_bounds(segments: list[list[tuple[int, int]]], seq_len: int) -> torch.Tensor:
    """The documents of every row as one int64 tensor of boundaries, rows laid end to end (``[0, ..., b * S]``)."""
    starts = [r * seq_len + start for r, row in enumerate(segments) for start, _ in row]
    return torch.tensor([*starts, len(segments) * seq_len], dtype=torch.int64)


class DocumentHook:
    """The decoder's forward pre-hook: the documents of the whole rows, once per forward, for every layer.

    With a topology (SP): one small collective every rank always completes checks the shards' shapes (so a bad
    input raises everywhere instead of hanging), the ``position_ids`` of the whole rows are gathered, and the
    attention mask is dropped (SP builds the attention pattern from the documents). Without one (sp_size 1, hybrid
    layers kept apart per document): the local rows' positions, nothing during cached decoding.
    ``layout`` and ``positions`` (``[b, s/P]``, each local token's position in its document) are this forward's.
    """

    def __init__(self, topology: SPTopology | None, sharding: SequenceSharding):
        self.topology, self.sharding = topology, sharding
        self.context: dict[str, Any] = {}  # what this model's layers find under SP_KWARG
        # run before each forward's first collective (the same on every rank): raise on what SP can't run
        self.forward_checks: dict[str, Callable[[], None]] = {}
        self.layout: DocumentLayout | None = None
        self.positions: torch.Tensor | None = None
        self.outer_positions: torch.Tensor | None = None  # the model's own position_ids during its forward

    def attach(self, model: torch.nn.Module, *extra: torch.utils.hooks.RemovableHandle) -> None:
        """Register on ``model``'s decoder, replacing what an earlier ``attach`` left there (``extra``: handles that
        go with it, e.g. rope hooks)."""
        decoder = forward_decoder(model)
        detach_documents(model)
        handles = [
            decoder.register_forward_pre_hook(self, with_kwargs=True),
            decoder.register_forward_hook(_leave_scope, always_call=True),
            *extra,
        ]
        if decoder is not model:  # the model may drop what it was given (Mamba2ForCausalLM: position_ids)
            handles.append(model.register_forward_pre_hook(self._outer_call, with_kwargs=True))
            handles.append(model.register_forward_hook(self._outer_done, always_call=True))
        _HOOKS[decoder] = (self, handles)

    def _outer_call(self, module, args, kwargs) -> None:
        """Enter the model's scope (left by ``_outer_done``): an SP forward unless the decoder won't pass documents."""
        _SCOPE.set((*_SCOPE.get(), {_OUTSIDE_DECODER: self.topology is not None or not _decoding(kwargs)}))
        self.outer_positions = kwargs.get("position_ids")

    def _outer_done(self, module, args, output) -> None:
        self.outer_positions = None
        _leave_scope(module, args, output)

    def _position_ids(self, kwargs) -> torch.Tensor | None:
        """The decoder's ``position_ids``, else those its model was called with and didn't pass on."""
        positions = kwargs.get("position_ids")
        return self.outer_positions if positions is None else positions

    def __call__(self, module, args, kwargs):
        """Pass the documents down (and enter the SP scope: ``scoped_sp_kwargs``, left by the decoder's forward
        hook)."""
        _SCOPE.set((*_SCOPE.get(), {}))  # entered first: the forward hook leaves it even if this raises
        passed = self._pass_down(args, kwargs)
        kept = {k: v for k, v in kwargs.items() if k.startswith(SP_KWARGS_PREFIX)}
        _SCOPE.set((*_SCOPE.get()[:-1], kept))
        return passed

    def _pass_down(self, args, kwargs):
        if self.topology is None and (BOUNDS_KWARG in kwargs or _decoding(kwargs)):
            return None  # under SP (an SP hook gave the bounds), or decoding
        for check in self.forward_checks.values():
            check()
        if self.topology is None:
            tokens = _tokens(args, kwargs)
            positions = self._position_ids(kwargs)
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            self.positions = positions.expand(tokens.shape[0], -1)
            self.layout = DocumentLayout.from_position_ids(self.positions)
            kwargs["use_cache"] = False
        else:
            self._gather(args, kwargs)
            kwargs.update(attention_mask=None, use_cache=False)
        kwargs.update(**{BOUNDS_KWARG: document_bounds(self.layout.segments, self.layout.position_ids.shape[1])})
        if self.context:
            kwargs[SP_KWARG] = self.context
        return args, kwargs

    def _gather(self, args, kwargs) -> None:
        tokens = _tokens(args, kwargs)
        batch, local_len = tokens.shape[:2]
        group, sp_size = self.topology.sp_group, self.topology.sp_size
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):  # per layer type, as a VLM base hands them on (Gemma3: the media pre-hook's)
            mask = next(iter(mask.values()), None)
        if mask is not None and mask.ndim != 2:
            raise ValueError(
                f"SP got a prepared {mask.ndim}-D attention mask; pass the [batch, seq] padding mask (or none): SP "
                "builds the attention pattern from the documents' positions."
            )
        logits_to_keep = kwargs.get("logits_to_keep")
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:  # Gemma4's decoder would slice its last tokens
            raise ValueError(
                f"SP got logits_to_keep={logits_to_keep}: each rank holds part of the sequence, so its last tokens "
                "are not the sequence's. Call the model without logits_to_keep under sequence parallelism."
            )
        has_padding = mask is not None and not bool(mask.bool().all())
        # One small collective every rank always completes, so a bad input raises everywhere instead of hanging.
        shapes = all_gather_along(
            torch.tensor([[batch, local_len, int(has_padding)]], device=tokens.device), 0, group
        ).tolist()
        if any(row[:2] != shapes[0][:2] for row in shapes):
            raise ValueError(
                "Sequence-parallel ranks received shards of different shapes [batch, local_len]: "
                f"{[row[:2] for row in shapes]}. Every rank of an SP group must get the same batch, split into equal "
                "shards (SPTrainer pads the sequence to a multiple of sp_size)."
            )
        padded = any(row[2] for row in shapes)
        full_len = local_len * sp_size
        if full_len % self.sharding.multiple:
            raise ValueError(
                f"Sequence-parallel shards of {local_len} tokens make a sequence of {full_len}, not a multiple of "
                f"{self.sharding.multiple} (2 x sp_size with a ring); pad the batch with SequenceSharding.shard_batch."
            )
        position_ids = self._position_ids(kwargs)
        rope = None  # multimodal rotary positions [4, b, s/P]: documents come from the text row, the rest passes on
        if position_ids is not None and position_ids.ndim == 3:
            if position_ids.shape[0] != 4:
                raise ValueError(
                    f"SP got position_ids of shape {tuple(position_ids.shape)}: 3-D positions need a text row first "
                    "([4, batch, seq], as hf_sp_trainer.SPMultimodalCollator builds them) to tell documents apart."
                )
            rope, position_ids = position_ids, position_ids[0]
        if position_ids is None:
            position_ids = self.sharding.positions(full_len, self.topology.sp_rank).to(tokens.device).unsqueeze(0)
        position_ids = position_ids.expand(batch, -1)
        self.positions = position_ids
        if padded:  # only the SP padding may be masked (a document of its own at the end): checked on the full rows
            keep = torch.ones_like(position_ids) if mask is None else mask.to(position_ids.dtype).expand(batch, -1)
            full, full_mask = self.sharding.unshard(all_gather_along(torch.stack([position_ids, keep]), 2, group), 2)
            check_sp_padding(full, full_mask, self.sharding.multiple)
        else:
            full = self.sharding.unshard(all_gather_along(position_ids, 1, group))
        self.layout = DocumentLayout.from_position_ids(full)
        kwargs["position_ids"] = position_ids if rope is None else rope


def relay_sp_kwargs(decoder: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Carry SP's kwargs past every layer of ``decoder`` that calls its attention without ``**kwargs`` (Nemotron's and
    StableLM's decoder layers): the layer's pre-hook keeps the ``sp_*`` kwargs it received, its attention's pre-hook
    adds them. Activation checkpointing recomputes the layer with the kwargs of its forward, so a recompute relays
    the same ones. Returns the hook handles (they go with ``DocumentHook.attach``)."""
    handles = []
    for where, parent, child_name in attention_without_kwargs(decoder):
        kept: dict[str, Any] = {}

        def keep(module, args, kwargs, kept=kept):
            kept.clear()
            kept.update({k: v for k, v in kwargs.items() if k.startswith(SP_KWARGS_PREFIX)})

        def add(module, args, kwargs, kept=kept, where=where):
            relayed = kept
            if BOUNDS_KWARG not in relayed:  # a decoder that calls its layers without **kwargs (Falcon's, 5.25)
                relayed = {k: v for k, v in scoped_sp_kwargs().items() if k.startswith(SP_KWARGS_PREFIX)}
            if BOUNDS_KWARG not in relayed:
                raise RuntimeError(
                    f"SP's document bounds didn't reach {where}: its layer was called without them (outside a "
                    "forward of the model SP was attached to, or by a caller that drops **kwargs)."
                )
            return args, {**kwargs, **relayed}

        handles.append(parent.register_forward_pre_hook(keep, with_kwargs=True))
        handles.append(getattr(parent, child_name).register_forward_pre_hook(add, with_kwargs=True))
    return handles


def current_scope() -> tuple[dict[str, Any], ...]:
    """The SP kwargs of the decoders being run (``DocumentHook``), innermost last: what ``run_in_scope`` restores."""
    return _SCOPE.get()


def scoped_sp_kwargs() -> dict[str, Any]:
    """The ``sp_*`` kwargs the innermost decoder being run passed down to its layers (empty outside one): how a
    kernel called without ``**kwargs`` (Mamba1's selective scan; every layer of ``MambaModel``) finds them."""
    scope = _SCOPE.get()
    return scope[-1] if scope else {}


def in_sp_forward() -> bool:
    """An SP forward (or one keeping documents apart) is running the caller: the innermost decoder passed documents
    down, or the caller runs in such a model's forward outside its decoder (where none reach it)."""
    scope = _SCOPE.get()
    return bool(scope) and (scope[-1].get(BOUNDS_KWARG) is not None or bool(scope[-1].get(_OUTSIDE_DECODER)))


def refuse_without_documents(kernel: str) -> None:
    """Raise inside an SP forward (``in_sp_forward``): ``kernel``, a swapped function reached without SP's document
    bounds, would run its installed version on this rank's shard as if it were whole documents."""
    if in_sp_forward():
        raise RuntimeError(
            f"{kernel} was called during a sequence-parallel forward without SP's document bounds (called outside "
            "the model's decoder, or in a recompute outside the forward's scope): its installed version would run "
            "on this rank's shard as if it were whole documents. Call it inside the decoder forward, or run this "
            "model with sp_size=1."
        )


def run_in_scope(scope: tuple[dict[str, Any], ...], function, *args, **kwargs):
    """``function(*args, **kwargs)`` with ``scope`` (a ``current_scope()`` taken earlier) as the SP scope: an
    activation-checkpoint recompute, run in the backward outside any decoder forward, sees the scope of its forward."""
    token = _SCOPE.set(scope)
    try:
        return function(*args, **kwargs)
    finally:
        _SCOPE.reset(token)


def detach_documents(model: torch.nn.Module) -> None:
    """Remove what ``DocumentHook.attach`` registered on ``model``'s decoder (nothing if it registered nothing)."""
    _, handles = _HOOKS.pop(forward_decoder(model), (None, []))
    for handle in handles:
        handle.remove()


def attached_documents(model: torch.nn.Module) -> DocumentHook | None:
    """The ``DocumentHook`` attached to ``model``'s decoder (its SP, or its documents kept apart), if any."""
    return _HOOKS.get(forward_decoder(model), (None, []))[0]


def _leave_scope(module, args, output) -> None:
    _SCOPE.set(_SCOPE.get()[:-1])


def _decoding(kwargs) -> bool:
    return kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None or bool(kwargs.get("use_cache"))


def _tokens(args, kwargs) -> torch.Tensor:
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    return input_ids if input_ids is not None else kwargs["inputs_embeds"]
