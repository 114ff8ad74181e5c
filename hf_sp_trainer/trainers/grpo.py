"""``SPGRPOTrainer`` / ``SPRLOOTrainer``: TRL's online RL trainers with sequence parallelism (docs/grpo.md).

Generation runs without SP (the model's own attention, full sequences; the SP group's first rank broadcasts its
completions so every rank of the group holds the same ones). Scoring prompt+completion (policy, old policy, reference)
runs sequence-parallel through the preference hooks (exact per-token log-probs / entropies, and an MoE policy's router
aux loss, on every SP rank). TRL's gathers, advantage slicing and normalisers see a data-parallel view of the
accelerator (one copy per SP group): the trainer's ``accelerator`` is a view during TRL's step code (the accelerator
itself is not modified), and TRL's module-level ``gather`` / ``gather_object`` go through the patch registry.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import transformers
import trl

from .. import patches
from ..memory import MemoryArguments
from ..model.decoder import unwrap_peft
from .arguments import SequenceParallelArguments
from .scoring.hooks import LogProbHooks
from .scoring.mixin import PreferenceSPMixin, refuse


class PolicyLogProbHooks(LogProbHooks):
    """``LogProbHooks`` for GRPO/RLOO batches (left-padded prompt + right-padded completion, column positions) that
    step aside while the trainer generates."""

    column_positions = True
    passthrough = False

    def before(self, module, args, kwargs):
        return None if self.passthrough else super().before(module, args, kwargs)

    def after(self, module, args, kwargs, output):
        return None if self.passthrough else super().after(module, args, kwargs, output)


SP_GENERATION_MODES = ("replicate", "split")


@dataclass
class OnlineRLArguments:
    """The GRPO / RLOO field for generation under SP."""

    sp_generation: str = field(
        default="replicate",
        metadata={
            "help": "How an SP group generates: 'replicate' (every rank generates all of the group's completions and "
            "the first rank's are kept: the same samples as TRL's process for this data-parallel rank) or 'split' "
            "(each rank generates 1/sp_size of them, gathered over the group: sp_size times less generation per "
            "rank; sampled completions come from other random streams than TRL's, greedy ones are the same)."
        },
    )


class _DPWorldSize:
    """Config mixin: TRL's generation-batch arithmetic counts data-parallel ranks (``world_size // sp_size``);
    ``TrainingArguments``' own post-init (DeepSpeed's batch arithmetic, ...) keeps the real world size
    (``_RealWorldSize``, placed between TRL's config and ``TrainingArguments`` in the MRO)."""

    _sp_dp_world = False

    @property
    def world_size(self) -> int:
        ws = super().world_size
        return ws // self.sp_size if self._sp_dp_world and self.sp_size > 1 else ws

    def _sp_post_init(self, post_init) -> None:
        self._sp_dp_world = True
        try:
            post_init()
        finally:
            self._sp_dp_world = False
        if self.sp_generation not in SP_GENERATION_MODES:
            raise ValueError(f"sp_generation={self.sp_generation!r}: use one of {SP_GENERATION_MODES}.")
        if self.sp_size > 1:
            refuse(
                {
                    "use_vllm": self.use_vllm,
                    "use_transformers_continuous_batching": getattr(
                        self, "use_transformers_continuous_batching", False
                    ),
                    "use_liger_kernel": getattr(self, "use_liger_kernel", False),
                },
                "generation runs with transformers' generate and the loss with TRL's fused log-prob head",
                "Use the default generation and loss, or sp_size=1.",
            )
        self._check_sequence_parallel()


class _RealWorldSize(transformers.TrainingArguments):
    def __post_init__(self):
        dp_world, self._sp_dp_world = self._sp_dp_world, False
        try:
            super().__post_init__()
        finally:
            self._sp_dp_world = dp_world


@dataclass
class GRPOConfig(
    _DPWorldSize, OnlineRLArguments, SequenceParallelArguments, MemoryArguments, trl.GRPOConfig, _RealWorldSize
):
    """``trl.GRPOConfig`` plus the sequence-parallel and memory-stack fields."""

    def __post_init__(self):
        self._sp_post_init(super().__post_init__)


@dataclass
class RLOOConfig(
    _DPWorldSize, OnlineRLArguments, SequenceParallelArguments, MemoryArguments, trl.RLOOConfig, _RealWorldSize
):
    """``trl.RLOOConfig`` plus the sequence-parallel and memory-stack fields."""

    def __post_init__(self):
        self._sp_post_init(super().__post_init__)


class OnlineRLSPMixin(PreferenceSPMixin):
    """SP for TRL's GRPO and RLOO trainers."""

    sp_hooks_cls = PolicyLogProbHooks

    def __init__(self, *args, **kwargs):
        self._sp_view_depth = 0
        self._sp_generation_calls = 0
        super().__init__(*args, **kwargs)
        if self.sp is not None:
            # TRL seeds each process differently (``seed + process_index``) so that data-parallel ranks sample
            # different completions; the SP ranks of a group are one data-parallel rank and share its seed.
            from accelerate.utils import set_seed

            set_seed(self.args.seed + self.sp.topology.dp_rank)
            trl_module = sys.modules[next(c for c in type(self).__mro__ if c.__module__.startswith("trl.")).__module__]
            patch_trl_gathers(trl_module)

    def sp_after_init(self) -> None:
        super().sp_after_init()
        refuse(
            {
                "vision-language model": getattr(self, "_is_vlm", False),  # (split generation passes no images)
                "tools": getattr(self, "tools", None),
                "rollout_func": getattr(self, "rollout_func", None),
                "environments": getattr(self, "environments", None) or getattr(self, "environment_factory", None),
            },
            "only text tokens of single-turn completions generated by transformers' generate are sharded",
            "Use a text-only model and single-turn generation without a custom rollout, or sp_size=1.",
        )

    # -- generation without SP ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _sp_generation(self):
        policy = unwrap_peft(self.model)
        for hooks in self._sp_hooks:
            hooks.passthrough = True
        self.sp.attention.detach(policy)
        router_loss = self.sp.router_loss  # MoE: generation's (discarded) aux loss is transformers', no collectives
        try:
            with router_loss.suspend() if router_loss is not None else contextlib.nullcontext():
                yield
        finally:
            self.sp.attention.attach(policy)
            for hooks in self._sp_hooks:
                hooks.passthrough = False

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        if self.sp is None:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        topo = self.sp.topology
        if self.args.sp_generation == "split" and len(prompt_ids) >= topo.sp_size:
            return self._sp_split_generation(prompt_ids, *args, **kwargs)
        with self._sp_generation():
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        # Every rank generated (RNG streams and any collectives in lock-step); the group's first rank's result wins.
        box = [out]
        dist.broadcast_object_list(box, src=dist.get_global_rank(topo.sp_group, 0), group=topo.sp_group)
        return box[0]

    def _sp_split_generation(self, prompt_ids, *args, **kwargs):
        """Each SP rank generates a contiguous 1/sp of the rows (sampling from its own seeded stream, the global
        one left untouched so the ranks stay in step), then the group gathers them in order."""
        topo = self.sp.topology
        n, sp = len(prompt_ids), topo.sp_size
        mine = prompt_ids[topo.sp_rank * n // sp : (topo.sp_rank + 1) * n // sp]
        self._sp_generation_calls += 1
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with self._sp_generation(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(hash((self.args.seed, self._sp_generation_calls, topo.dp_rank, topo.sp_rank)) % 2**63)
            out = super()._generate_single_turn(mine, *args, **kwargs)
        parts = [None] * sp
        dist.all_gather_object(parts, out, group=topo.sp_group)
        if not isinstance(out, tuple):  # RLOO: the completion ids
            return [c for part in parts for c in part]
        completions = [c for part, _ in parts for c in part]  # GRPO: (completion ids, log-probs or None)
        logprobs = None if any(lp is None for _, lp in parts) else [x for _, lp in parts for x in lp]
        return completions, logprobs

    # -- a data-parallel view of the accelerator --------------------------------------------------------------------
    @contextlib.contextmanager
    def _sp_dp_view(self):
        """Within: ``self.accelerator`` is a data-parallel view of the accelerator (``dp_accelerator_view``) and TRL's
        module-level ``gather`` / ``gather_object`` keep one copy per SP group (``patch_trl_gathers``). The
        accelerator itself is not modified: other holders of it see the real world."""
        if self.sp is None or self._sp_view_depth:
            self._sp_view_depth += 1
            try:
                yield
            finally:
                self._sp_view_depth -= 1
            return
        accelerator, topo = self.accelerator, self.sp.topology
        self.accelerator = dp_accelerator_view(accelerator, topo)
        self._sp_view_depth += 1
        _DP_VIEWS.append(topo)
        try:
            yield
        finally:
            _DP_VIEWS.pop()
            self._sp_view_depth -= 1
            self.accelerator = accelerator

    def training_step(self, *args, **kwargs):
        with self._sp_dp_view():
            return super().training_step(*args, **kwargs)

    def _generate_and_score_completions(self, *args, **kwargs):
        with self._sp_dp_view():
            return super()._generate_and_score_completions(*args, **kwargs)

    def compute_loss(self, *args, **kwargs):
        with self._sp_dp_view():
            return super().compute_loss(*args, **kwargs)


# -- the data-parallel view TRL's online-RL code runs in --------------------------------------------------------------
# TRL's gathers, advantage slicing and normalisers count processes; under SP a group's ranks hold one data-parallel
# rank's batch, so they must see one copy per SP group: the trainer's ``accelerator`` is a view (a subclass instance
# sharing the real accelerator's state, only while TRL's step code runs), and the two functions TRL's module imported
# from accelerate (``gather`` for the rewards and RLOO's KL, ``gather_object`` for the logged completions; module
# globals, with no trainer method to override around them) are swapped once through the patch registry for entries
# that keep one copy per SP group while a view is active.
_DP_VIEWS: list = []  # the topology of each active view (innermost last)
_VIEW_CLASSES: dict[type, type] = {}


def _dp_rows(full: torch.Tensor, topo) -> torch.Tensor:
    """Rows of a whole-world gather (rank order) kept once per SP group: the first rank's of each."""
    if full.ndim == 0:
        return full
    return torch.cat(full.chunk(topo.dp_size * topo.sp_size)[0 :: topo.sp_size])


def _dp_items(full: list, topo) -> list:
    world, step = topo.dp_size * topo.sp_size, topo.sp_size
    if len(full) % world:
        raise RuntimeError(f"gather_object: {len(full)} items over {world} ranks are not equal per rank.")
    n = len(full) // world
    return [x for r in range(0, world, step) for x in full[r * n : (r + 1) * n]]


class DataParallelView:
    """Mixed in front of the accelerator's class: one process per data-parallel rank (an SP group counted once)."""

    __slots__ = ()  # the view's own topology is a slot of its class; everything else is the accelerator's state

    @property
    def num_processes(self) -> int:
        return self._sp_topology.dp_size

    @property
    def process_index(self) -> int:
        return self._sp_topology.dp_rank

    def gather(self, tensor):
        return _dp_rows(super().gather(tensor), self._sp_topology)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        out = super().reduce(tensor, reduction=reduction, scale=scale)
        return out / self._sp_topology.sp_size if reduction == "sum" else out  # each SP group once (sp = 2^k: exact)


def dp_accelerator_view(accelerator, topo):
    """A data-parallel view of ``accelerator``: an instance of a subclass of its class (``DataParallelView`` first)
    sharing its state (``__dict__``), so every method and attribute is the accelerator's but the process counts,
    ``gather`` and ``reduce``. ``accelerator`` itself is unchanged."""
    base = type(accelerator)
    if base not in _VIEW_CLASSES:
        _VIEW_CLASSES[base] = type(
            f"DataParallelView{base.__name__}", (DataParallelView, base), {"__slots__": ("_sp_topology",)}
        )
    view = object.__new__(_VIEW_CLASSES[base])
    view.__dict__ = accelerator.__dict__
    view._sp_topology = topo
    return view


def check_accelerates(name: str, fn) -> None:
    """TRL's module calls accelerate's own ``gather`` (the whole world's tensors, concatenated in rank order) or
    ``gather_object`` (every rank's items, in rank order), which the entry calls before keeping one copy per SP
    group."""
    import accelerate.utils

    if fn is not getattr(accelerate.utils, name):
        raise ValueError(f"TRL's {name} is {fn!r}, not accelerate.utils.{name}")


def _view_entry(keep_view_share, original):
    """``original`` (accelerate's gather), then, while a data-parallel view is active, ``keep_view_share`` of what it
    gathered: one copy per SP group."""

    @functools.wraps(original)
    def entry(value):
        full = original(value)
        return keep_view_share(full, _DP_VIEWS[-1]) if _DP_VIEWS else full

    return entry


def patch_trl_gathers(module) -> None:
    """Swap ``gather`` / ``gather_object`` of TRL's trainer ``module`` (once) for the data-parallel view's entries."""
    reason = "TRL's online-RL step code sees one copy per SP group while the trainer's data-parallel view is active"
    for name, keep_view_share in (("gather", _dp_rows), ("gather_object", _dp_items)):
        patches.patch(
            module,
            name,
            wrap=functools.partial(_view_entry, keep_view_share),
            check=functools.partial(check_accelerates, name),
            reason=reason,
            fix="Use the tested TRL, or sp_size=1.",
        )


class SPGRPOTrainer(OnlineRLSPMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with sequence parallelism over ``args.sp_size`` ranks; ``sp_size=1`` is exactly TRL."""


class SPRLOOTrainer(OnlineRLSPMixin, trl.RLOOTrainer):
    """``trl.RLOOTrainer`` with sequence parallelism over ``args.sp_size`` ranks; ``sp_size=1`` is exactly TRL."""
