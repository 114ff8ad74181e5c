"""What a layer's attention takes from token positions besides the document layout, computed from each token's
position in its document (the whole sequence's), not from the shard's row index.

Two rules, both Llama-4's (found by config and module attributes, not by family name), and a window:

- **Chunked attention** (``layer_types`` entry ``"chunked_attention"``, ``attention_chunk_size`` C): a token sees
  the earlier tokens of its own C-token chunk only, chunks counted from its document's start (transformers' mask
  remaps packed positions per document). Under SP a chunk boundary is a document boundary for those layers: their
  layout is the one of ``position_ids % C`` (a new chunk restarts at 0 like a new document).
- **NoPE temperature** (``attn_temperature_tuning`` on layers without rope): the query is scaled by
  ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``. transformers computes ``p`` as
  ``arange(local length)``, the row index of the shard it sees; one device sees each document from 0. SP rescales
  the query it receives by ``t(position in the document) / t(row index)``, an exact 1 wherever both agree.
- **A window only in the mask** (PhiMoE: ``config.sliding_window`` reaches only the mask SP drops;
  ``model.mixers.MASK_ONLY_WINDOWS``): the module is marked with it, and SP's attention passes it on as the
  ``sliding_window`` of the module's own layers (Qwen2-MoE's form).
"""

from __future__ import annotations

import torch

from ..documents import DocumentLayout
from ..model.mixers import mask_only_window

CHUNK_MARK = "_hf_sp_attention_chunk"  # on the modules of chunked-attention layers: the chunk size
TEMPERATURE_MARK = "_hf_sp_nope_temperature"  # on NoPE attention modules with temperature tuning: (floor, scale)
WINDOW_MARK = "_hf_sp_mask_window"  # on attention modules whose window the model applies only in its mask
CHUNKED_LAYER = "chunked_attention"


def position_rules(decoder: torch.nn.Module, config) -> dict[torch.nn.Module, tuple[int | None, tuple | None]]:
    """Each module of ``decoder`` with its ``(chunk size, (floor_scale, attn_scale))`` (``None`` where a rule doesn't
    apply; ``config``: the text config). Raises a ``ValueError`` (no collective, no side effect) where SP can't tell
    which modules a rule applies to."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    chunked = {i for i, t in enumerate(layer_types) if t == CHUNKED_LAYER}
    chunk = getattr(config, "attention_chunk_size", None)
    name = type(decoder).__name__
    if chunked and not (isinstance(chunk, int) and chunk > 0):
        raise ValueError(f"{name} has chunked-attention layers but attention_chunk_size={chunk!r}.")
    if chunked and not any(isinstance(getattr(m, "layer_idx", None), int) for m in decoder.modules()):
        raise ValueError(
            f"{name} has chunked-attention layers {sorted(chunked)}, but no module names its layer_idx, so SP can't "
            "tell them from its full-attention layers. Use sp_size=1 for this model."
        )
    return {
        m: (chunk if getattr(m, "layer_idx", None) in chunked else None, _temperature_of(m, name))
        for m in decoder.modules()
    }


def mark_position_rules(decoder: torch.nn.Module, config) -> None:
    """Mark ``decoder``'s modules with the rules of ``position_rules`` and their mask-only windows."""
    for m, (chunk, temperature) in position_rules(decoder, config).items():
        setattr(m, CHUNK_MARK, chunk)
        setattr(m, TEMPERATURE_MARK, temperature)
        setattr(m, WINDOW_MARK, mask_only_window(m, config))


def module_window(module: torch.nn.Module) -> int | None:
    """The sliding window of ``module``'s attention: its own attribute, else the one its model's mask applies."""
    return getattr(module, "sliding_window", None) or getattr(module, WINDOW_MARK, None)


def _temperature_of(module: torch.nn.Module, name: str) -> tuple[float, float] | None:
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    floor, scale = getattr(module, "floor_scale", None), getattr(module, "attn_scale", None)
    if floor is None or scale is None:
        raise ValueError(
            f"{name}: {type(module).__name__} tunes its NoPE attention temperature, but without floor_scale / "
            "attn_scale SP can't compute it from the positions in each document. Use sp_size=1 for this model."
        )
    return float(floor), float(scale)


def chunk_layout(layout: DocumentLayout, chunk: int | None) -> DocumentLayout:
    """The documents a chunked layer sees: every ``chunk`` tokens of a document start a new one (once per step)."""
    if chunk is None:
        return layout
    return layout.cached(("chunks", chunk), lambda: DocumentLayout.from_position_ids(layout.position_ids % chunk))


def nope_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama-4's query temperature at ``positions`` (the same ops as transformers')."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def retune_temperature(module: torch.nn.Module, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``query`` ``[b, heads, s, d]`` as scaled by its token's position in its document (``positions`` ``[b, s]``)
    instead of its row index in the shard; unchanged for a module without the temperature."""
    rule = getattr(module, TEMPERATURE_MARK, None)
    if rule is None:
        return query
    rows = torch.arange(query.shape[2], device=query.device)
    ratio = nope_temperature(positions.to(query.device), *rule) / nope_temperature(rows, *rule)
    return (query * ratio[:, None, :, None]).to(query.dtype)


def _runtime_length_rope(module: torch.nn.Module) -> bool:
    """A rotary embedding whose frequencies follow the longest position of each call: transformers' dynamic NTK
    (``"dynamic"`` in its rope type) and longrope (short or long factors by ``max(position_ids) + 1``)."""
    rope_type = getattr(module, "rope_type", None)
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


class WholeSequenceRope:
    """Forward hooks that let a runtime-length rotary embedding (``_runtime_length_rope``) choose its frequencies from
    the whole sequence, as one device does, instead of from this rank's shard: the call gets one extra position, the
    largest of the SP group's (a max all-reduce, in the same call on every rank), and its outputs drop it again."""

    def __init__(self, group) -> None:
        self.group = group

    def attach(self, decoder: torch.nn.Module) -> list:
        """Hook every such rotary embedding of ``decoder``; returns the hook handles."""
        handles = []
        for m in decoder.modules():
            if _runtime_length_rope(m):
                handles.append(m.register_forward_pre_hook(self._with_longest, with_kwargs=True))
                handles.append(m.register_forward_hook(self._without_longest, with_kwargs=True))
        return handles

    def _with_longest(self, module, args, kwargs):
        import torch.distributed as dist

        in_kwargs = "position_ids" in kwargs
        positions = kwargs["position_ids"] if in_kwargs else args[1]
        # a rank may have no positions in this call (DeepSeek-V4: no compressed window ends in its shard): it still
        # joins the all-reduce, or the others wait forever
        longest = positions.amax().reshape(1).clone() if positions.numel() else positions.new_full((1,), -1)
        if self.group is not None:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.group)
        positions = torch.cat([positions, longest.to(positions.dtype).expand(*positions.shape[:-1], 1)], dim=-1)
        if in_kwargs:
            return args, {**kwargs, "position_ids": positions}
        return (args[0], positions, *args[2:]), kwargs

    @staticmethod
    def _without_longest(module, args, kwargs, output):
        positions = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        n = positions.shape[-1]  # with the extra position

        def drop(t: torch.Tensor) -> torch.Tensor:
            if t.ndim < 2 or t.shape[-2] != n:
                raise RuntimeError(
                    f"{type(module).__name__} returned {tuple(t.shape)} for {n} positions: SP expects the positions "
                    "along dim -2 of its rotary outputs (this transformers version changed its rotary embedding)."
                )
            return t[..., :-1, :]

        return tuple(drop(t) for t in output) if isinstance(output, tuple) else drop(output)
