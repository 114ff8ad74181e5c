"""Tiled MLP: each decoder MLP runs over ``n`` token tiles and recomputes one tile at a time in backward.

The MLP is per token, so ``mlp(x) = concat_t mlp(x_t)`` over any split of the tokens into tiles ``x_t``, and

    dL/dx_t = J_t^T g_t,        dL/dW = sum_t (dL/dW)_t,

where ``g_t`` is the tile's slice of the output gradient. Forward keeps only ``x`` (no ``s x intermediate``
activations); backward recomputes one tile at a time, so one tile's intermediate (``s/n x intermediate_size``) lives
at a time. Each tile is differentiated with ``torch.autograd.grad`` (nothing accumulated) and the parameter gradients
are summed; the sums reach ``.grad`` once per call, as without tiling (returned by the autograd Function, or under
ZeRO-3 accumulated with the last tile): DDP / FSDP2 / DeepSpeed reduce gradients from hooks on that accumulation.

The MLP is switched to a tiled subclass of its own class (``module.__class__`` replacement, as FSDP2 does, through the
patch registry after a check that the MLP is per token), so parameter names, state dicts, LoRA adapters and hooks are
unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import patches
from ..model.decoder import decoder_layers

_TILED_CLASSES: dict[type, type] = {}


MIN_DEFAULT_TILE = 1024  # tokens: smaller tiles save nothing worth their per-tile overhead


def _tiles(rows: int, num_shards: int | None, hidden: int) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges of the tiles; default ``ceil(rows / max(hidden, 1024))`` tiles (about square)."""
    n = num_shards or math.ceil(rows / max(hidden, MIN_DEFAULT_TILE))
    n = max(1, min(n, rows))
    bounds = [rows * i // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _tiled_forward(mlp: Callable, num_shards: int | None, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = None
    for start, end in _tiles(rows.shape[0], num_shards, rows.shape[1]):
        y = mlp(rows[start:end])
        if out is None:
            out = y.new_empty(rows.shape[0], y.shape[-1])
        out[start:end] = y
    return out.view(*x.shape[:-1], out.shape[-1])


class _TiledMLPFunction(torch.autograd.Function):
    """``y = mlp(x)`` tile by tile.

    ``anchor_and_params``: an empty leaf that requires grad when the MLP has trainable parameters (so ``y`` does even
    when ``x`` does not, e.g. LoRA on the first layer's MLP), then the trainable parameters, whose summed gradients
    ``backward`` returns. Under ZeRO-3 the parameters are empty placeholders outside their own Linear and can't be
    inputs (the gradient's shape is fixed by the input's); they are passed none, and ``backward`` accumulates their
    summed gradients into ``.grad`` itself.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, module: nn.Module, mlp: Callable, num_shards: int | None, x: torch.Tensor, *anchor_and_params
    ):
        ctx.module, ctx.mlp, ctx.num_shards = module, mlp, num_shards
        ctx.params_are_inputs = len(anchor_and_params) > 1
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        return _tiled_forward(mlp, num_shards, x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        rows, grad_rows = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        needs_x = ctx.needs_input_grad[3]
        grad_x = torch.empty_like(rows) if needs_x else None
        tiles = _tiles(rows.shape[0], ctx.num_shards, rows.shape[1])
        summed: list[torch.Tensor | None] = []  # per parameter: its gradient over the tiles so far
        device_type, autocast, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=autocast):
            for i, (start, end) in enumerate(tiles):
                tile = rows[start:end].detach().requires_grad_(needs_x)
                y, g = ctx.mlp(tile), grad_rows[start:end]
                # read after the recompute: ZeRO-3 gathers a Linear's weight in that Linear's forward
                params = [p for p in ctx.module.parameters() if p.requires_grad]
                summed = summed or [None] * len(params)
                if i + 1 == len(tiles) and params and not ctx.params_are_inputs:
                    _accumulate_last_tile(y, g, tile if needs_x else None, params, summed)
                    grads = [tile.grad] if needs_x else []
                else:
                    grads = list(torch.autograd.grad(y, [tile, *params] if needs_x else params, g, allow_unused=True))
                    summed = [_add(a, b) for a, b in zip(summed, grads[needs_x:], strict=True)]
                if needs_x:
                    grad_x[start:end] = grads[0]
        grad_x = grad_x.view_as(x) if needs_x else None
        grad_params = summed if ctx.params_are_inputs else []
        return None, None, None, grad_x, None, *grad_params


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return a if b is None else b if a is None else a.add_(b)


def _plus(extra: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return grad + extra


def _accumulate_last_tile(y, g, tile, params: list, summed: list) -> None:
    """Backward of the last tile into ``.grad``, each parameter's gradient plus (a one-off tensor hook) its sum over the
    earlier tiles: one accumulation per parameter, so the gradient hooks of ZeRO fire once."""
    handles = [
        p.register_hook(functools.partial(_plus, s)) for p, s in zip(params, summed, strict=True) if s is not None
    ]
    try:
        torch.autograd.backward(y, g, inputs=[tile, *params] if tile is not None else params)
    finally:
        for handle in handles:
            handle.remove()


class TiledMLP(nn.Module):
    """Mixed in front of an MLP class: ``forward`` runs the original one tile at a time."""

    tiled_mlp_num_shards: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mlp = super().forward
        trainable = [p for p in self.parameters() if p.requires_grad]
        if torch.is_grad_enabled() and (x.requires_grad or trainable):
            anchor = torch.empty(0, device=x.device, requires_grad=bool(trainable))
            inputs = trainable if all(p.numel() > 0 for p in trainable) else []  # none: ZeRO-3 placeholders
            return _TiledMLPFunction.apply(self, mlp, self.tiled_mlp_num_shards, x, anchor, *inputs)
        return _tiled_forward(mlp, self.tiled_mlp_num_shards, x)  # nothing to differentiate (e.g. evaluation)


def _tiled_class(cls: type) -> type:
    if issubclass(cls, TiledMLP):
        return cls
    if cls not in _TILED_CLASSES:
        tiled = type(f"Tiled{cls.__name__}", (TiledMLP, cls), {"__module__": __name__})
        globals()[tiled.__name__] = tiled  # so that pickling a tiled model finds the class by name
        _TILED_CLASSES[cls] = tiled
    return _TILED_CLASSES[cls]


def _is_dense_mlp(module: nn.Module) -> bool:
    """A per-token gated MLP: ``down_proj`` with ``gate_proj`` + ``up_proj`` (Llama, Qwen, Mistral, Gemma) or
    ``gate_up_proj`` (Phi3)."""
    children = dict(module.named_children())
    return "down_proj" in children and ("up_proj" in children or "gate_up_proj" in children)


def apply_tiled_mlp(model: nn.Module, num_shards: int | None = None) -> int:
    """Tile the ``mlp`` of every decoder layer of ``model``; returns how many MLPs were tiled."""
    if num_shards is not None and num_shards < 1:
        raise ValueError(f"tiled_mlp_num_shards must be a positive number of tiles, got {num_shards}.")
    layers = decoder_layers(model)
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    bad = sorted({type(layer).__name__ for layer, mlp in zip(layers, mlps, strict=True) if mlp is None})
    bad += sorted({type(mlp).__name__ for mlp in mlps if mlp is not None and not _is_dense_mlp(mlp)})
    if not layers or bad:
        raise ValueError(
            f"tiled_mlp=True needs decoder layers whose `mlp` is a dense per-token MLP (down_proj with gate_proj/"
            f"up_proj or gate_up_proj, as in Llama, Qwen2/3, Mistral, Gemma3, Phi3); {type(model).__name__} has "
            f"{len(layers)} decoder layers and unsupported parts {bad or '(no decoder layers)'}. Set tiled_mlp=False "
            "for this model."
        )
    names = {id(m): n for n, m in model.named_modules()}
    for mlp in mlps:
        if not isinstance(mlp, TiledMLP):
            patches.patch(
                mlp,
                "__class__",
                replacement=_tiled_class(type(mlp)),
                check=functools.partial(check_per_token, mlp),
                reason="tiled_mlp: the MLP's forward run one token tile at a time, each tile recomputed in backward",
                fix="Set tiled_mlp=False for this model.",
                where=names.get(id(mlp)),
                on_undo=_forget_shards,
            )
        mlp.tiled_mlp_num_shards = num_shards
    return len(mlps)


_PER_TOKEN_CHECKED: set[type] = set()


def check_per_token(mlp: nn.Module, cls: type | None = None) -> None:
    """The MLP is per token, what tiling relies on: its output for three tokens equals its outputs for each token
    alone (one forward of this instance on a small input, once per class; skipped where the parameters are not
    materialised here: ZeRO-3 placeholders, the meta device, where only the structure was checked)."""
    cls = type(mlp)
    params = list(mlp.parameters())
    hidden = getattr(getattr(mlp, "down_proj", None), "out_features", None)
    if cls in _PER_TOKEN_CHECKED or not params or hidden is None:
        return
    if any(p.numel() == 0 or p.is_meta or hasattr(p, "ds_id") or isinstance(p.data, DTensor) for p in params):
        return
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, hidden, generator=generator).to(device=params[0].device, dtype=params[0].dtype)
    modes = {m: m.training for m in mlp.modules()}
    mlp.eval()  # no dropout (a LoRA adapter's): deterministic, and no draw from the global RNG
    try:
        with torch.no_grad():
            whole = mlp(x).float()
            alone = torch.cat([mlp(x[:, i : i + 1]) for i in range(3)], dim=1).float()
    finally:
        for module, training in modes.items():
            module.training = training
    tolerance = 1e-4 if params[0].dtype == torch.float32 else 3e-2
    if not torch.allclose(whole, alone, rtol=tolerance, atol=tolerance * float(whole.abs().max().clamp(min=1))):
        raise ValueError(f"{cls.__qualname__} mixes tokens (its output for a token depends on the others)")
    _PER_TOKEN_CHECKED.add(cls)


def _forget_shards(mlp: nn.Module) -> None:
    mlp.__dict__.pop("tiled_mlp_num_shards", None)


def remove_tiled_mlp(model: nn.Module) -> None:
    """Undo ``apply_tiled_mlp``."""
    for module in model.modules():
        record = patches.find(module, "__class__")
        if isinstance(module, TiledMLP) and record is not None:
            patches.undo(record)
