"""The MoE router load-balancing loss, exact under sequence parallelism.

transformers' ``load_balancing_loss_func`` (one body shared by every MoE family that has one, via the modular
system) pools the router logits of all layers of a forward: ``C_e`` top-k assignments to expert ``e`` and ``S_e`` its
router-probability sum over the tokens, ``R`` the token count (padding masked), and
``aux = E * sum_e (C_e / R) * (S_e / R)``: one product of two averages over the whole batch. Computed per shard and
summed it is about ``sp_size x`` too strong, and its gradient is not the single-device one.

Under SP each rank all-reduces ``C``, ``R`` (and, for the reported value, ``S``) over its SP group in one collective
of ``2E + 1`` floats, and returns its **share** ``E * sum_e (C_e / R) * (S^rank_e / R)``: the shares sum to the
single-device loss and each rank's gradient flows through its own router probabilities (``C`` is discrete: no
gradient). A share is what every other SP loss term is (each rank's cross-entropy is its tokens' sum over the step's
count), so the Trainer's loss path stays exact as it is; TRL's paths read the recorded ``(share, value)``.

The model's own function is swapped in its modeling module (and in Mixtral's, which TRL's fused LM head imports)
through the patch registry (``hf_sp_trainer.patches``), only after checking on a small input that the installed
function still computes this formula; inside an SP forward the swap computes the share, outside it calls
transformers' function. A module whose function is
another formula (Doge's product-key experts) raises under SP instead of training on shard-local statistics. The SP
pad document is excluded through the ``attention_mask`` the sharding gives a padded shard, exactly as transformers
excludes padding.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .. import patches

FUNCTION = "load_balancing_loss_func"
TRL_FUSED_HEAD_MODULE = "transformers.models.mixtral.modeling_mixtral"  # where TRL's fused LM head imports it from
_ACTIVE: list[RouterLoss] = []  # the SP model whose forward is running (innermost last)


def router_sums(
    gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(C, S, R)`` of transformers' formula over this rank's tokens: top-k counts ``[E]`` (no gradient),
    probability sums ``[E]`` (fp32, with gradient) and the token count (padding, ``attention_mask == 0``, excluded)."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in gate_logits:
        routing = torch.softmax(layer.to(device), dim=-1)
        selected = torch.topk(routing, top_k, dim=-1).indices.reshape(-1)
        w = torch.ones(routing.shape[0], dtype=torch.float32, device=device) if weight is None else weight
        counts = counts + torch.zeros_like(counts).scatter_add_(0, selected, w.repeat_interleave(top_k))
        probs = probs + (routing.float() * w.unsqueeze(-1)).sum(dim=0)
        rows = rows + w.sum()
    return counts.detach(), probs, rows.detach()


def _formula(counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    rows = rows.clamp(min=1)
    return (counts / rows * (probs / rows)).sum() * num_experts


@dataclass
class RouterLoss:
    """The SP router loss of one model: active during its forwards, recording each forward's share and value."""

    group: dist.ProcessGroup
    handles: list = field(default_factory=list)
    last: tuple[torch.Tensor, torch.Tensor] | None = None  # (share, value) of the running / last forward
    suspended: bool = False  # forwards run transformers' own function (e.g. GRPO's generation, not sharded)

    def share(
        self, gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's share of the load-balancing loss of the whole sequence (the shares sum to it)."""
        counts, probs, rows = router_sums(gate_logits, num_experts, top_k, attention_mask)
        totals = torch.cat([counts, probs.detach(), rows.reshape(1)]).contiguous()
        dist.all_reduce(totals, group=self.group)
        counts, all_probs, rows = totals[:num_experts], totals[num_experts:-1], totals[-1]
        share = _formula(counts, probs, rows, num_experts)
        self.last = (share, _formula(counts, all_probs, rows, num_experts))
        return share

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(share, value)`` of the last forward (``None`` if it computed no router loss); ``value`` is the whole
        sequence's loss, the same on every rank of the SP group (no gradient)."""
        last, self.last = self.last, None
        return last

    @contextlib.contextmanager
    def suspend(self) -> Iterator[None]:
        """Forwards inside compute transformers' own (unsharded) loss, without collectives."""
        self.suspended = True
        try:
            yield
        finally:
            self.suspended = False

    def attach(self, model: nn.Module) -> None:
        """Swap the load-balancing function of ``model``'s modules and be the active one during its forwards."""
        importlib.import_module(TRL_FUSED_HEAD_MODULE)  # swapped before TRL's fused head first imports it
        for name in modules_to_swap(model):
            swap_in(name)
        self.handles = [
            model.register_forward_pre_hook(lambda *_: self._enter()),
            model.register_forward_hook(lambda *_: self._leave(), always_call=True),
        ]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _enter(self) -> None:
        self.last = None
        if not self.suspended:
            _ACTIVE.append(self)

    def _leave(self) -> None:
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()


def modules_to_swap(model: nn.Module) -> list[str]:
    """The modeling modules whose load-balancing function ``model``'s forward may call."""
    names = {type(m).__module__ for m in model.modules()} | {TRL_FUSED_HEAD_MODULE}
    return sorted(n for n in names if hasattr(sys.modules.get(n), FUNCTION))


def swap_in(module_name: str) -> patches.Patch:
    """Replace ``module_name.load_balancing_loss_func`` by the SP-aware one, through the patch registry (once).

    A function that computes the formula above gets the entry computing this rank's share under SP (checked first:
    ``check_the_formula``); any other (Doge's product-key experts) gets one that refuses under SP, so that it never
    trains on shard-local statistics. Outside an SP forward both call transformers' function."""
    module = sys.modules[module_name]
    record = patches.find(module, FUNCTION)
    if record is not None:
        return record
    if computes_the_formula(getattr(module, FUNCTION)):
        return patches.patch(
            module,
            FUNCTION,
            wrap=functools.partial(_share_entry, module_name),
            check=check_the_formula,
            reason="the MoE router loss of an SP forward: each rank's share of the whole sequence's loss",
            fix="Set output_router_logits=False (or router_aux_loss_coef=0), or sp_size=1.",
        )
    return patches.patch(
        module,
        FUNCTION,
        wrap=functools.partial(_refusing_entry, module_name),
        unchecked="another formula than SP's (computes_the_formula is False): under SP the entry raises, outside it "
        "calls the installed function unchanged, so it assumes nothing about that function",
        reason="refuse a load-balancing loss SP can't make exact (another formula) inside an SP forward",
    )


def _share_entry(module_name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def load_balancing_loss_func(*args, **kwargs):
        if not _ACTIVE:
            return original(*args, **kwargs)
        return _ACTIVE[-1].share(*_canonical_args(*args, **kwargs))

    return load_balancing_loss_func


def _refusing_entry(module_name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def load_balancing_loss_func(*args, **kwargs):
        if not _ACTIVE:
            return original(*args, **kwargs)
        raise ValueError(
            f"{module_name}.{FUNCTION} is not the load-balancing formula sequence parallelism makes exact "
            "(E * sum_e f_e * P_e over all layers' tokens); under SP it would see only this rank's shard. Set "
            "output_router_logits=False (or router_aux_loss_coef=0), or sp_size=1."
        )

    return load_balancing_loss_func


def check_the_formula(fn: Callable) -> None:
    """The installed function is transformers' pooled load-balancing loss ``E * sum_e (C_e / R) * (S_e / R)`` over
    all layers' tokens: its value on a small input, with and without a padding mask, equals ``router_sums``'."""
    if not computes_the_formula(fn):
        raise ValueError(
            f"{getattr(fn, '__module__', '?')}.{FUNCTION} no longer computes the pooled load-balancing loss "
            "sequence parallelism makes exact"
        )


def _canonical_args(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    return gate_logits, num_experts, top_k, attention_mask


def computes_the_formula(fn: Callable) -> bool:
    """Whether ``fn`` is transformers' pooled load-balancing loss (checked on a small input, with and without a
    padding mask): a release that changes it makes SP refuse the router loss instead of computing another one."""
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(10, 6, generator=generator, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    for m in (None, mask):
        try:
            got = fn(logits, 6, 2, m)
        except Exception:  # noqa: BLE001 - another signature: not the formula
            return False
        counts, probs, rows = router_sums(logits, 6, 2, m)
        if not torch.is_tensor(got) or not torch.allclose(got.double(), _formula(counts, probs, rows, 6).double()):
            return False
    return True


def sp_router_loss(model: nn.Module, group: dist.ProcessGroup) -> RouterLoss | None:
    """The SP router loss for ``model`` if any of its modules has a load-balancing function (else ``None``)."""
    if not modules_to_swap(model) or not any(hasattr(c, "output_router_logits") for c in _configs(model)):
        return None
    router_loss = RouterLoss(group)
    router_loss.attach(model)
    return router_loss


def _configs(model: nn.Module) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config, text]


__all__ = ["RouterLoss", "check_the_formula", "computes_the_formula", "router_sums", "sp_router_loss", "swap_in"]
