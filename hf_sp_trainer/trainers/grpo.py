"""``SPGRPOTrainer`` / ``SPRLOOTrainer``: TRL's online RL trainers with sequence parallelism (docs/grpo.md).

Generation runs without SP (the model's own attention, full sequences; the SP group's first rank broadcasts its
completions so every rank of the group holds the same ones). Scoring prompt+completion (policy, old policy, reference)
runs sequence-parallel through the preference hooks (exact per-token log-probs / entropies, and an MoE policy's router
aux loss, on every SP rank). TRL's gathers, advantage slicing and normalisers see a data-parallel view of the
accelerator (one copy per SP group).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import transformers
import trl

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
        if self.sp is None or self._sp_view_depth:
            self._sp_view_depth += 1
            try:
                yield
            finally:
                self._sp_view_depth -= 1
            return
        acc, topo = self.accelerator, self.sp.topology
        base = type(acc)
        world, step = topo.dp_size * topo.sp_size, topo.sp_size

        def dp_gather(tensor):
            full = base.gather(acc, tensor)
            if full.ndim == 0:
                return full
            return torch.cat(full.chunk(world)[0::step])

        def dp_gather_object(obj):
            from accelerate.utils import gather_object

            full = gather_object(obj)
            if len(full) % world:
                raise RuntimeError(f"gather_object: {len(full)} items over {world} ranks are not equal per rank.")
            n = len(full) // world
            return [x for r in range(0, world, step) for x in full[r * n : (r + 1) * n]]

        def dp_reduce(tensor, reduction="sum", scale=1.0):
            out = base.reduce(acc, tensor, reduction=reduction, scale=scale)
            return out / topo.sp_size if reduction == "sum" else out  # each SP group counted once (exact: sp = 2^k)

        view = type(
            f"DataParallelView{base.__name__}",
            (base,),
            {
                "num_processes": property(lambda s: topo.dp_size),
                "process_index": property(lambda s: topo.dp_rank),
                "gather": lambda s, tensor: dp_gather(tensor),
                "reduce": lambda s, tensor, reduction="sum", scale=1.0: dp_reduce(tensor, reduction, scale),
            },
        )
        module = sys.modules[next(c for c in type(self).__mro__ if c.__module__.startswith("trl.")).__module__]
        saved = {"gather": module.gather, "gather_object": module.gather_object}
        acc.__class__ = view
        module.gather, module.gather_object = dp_gather, dp_gather_object
        self._sp_view_depth += 1
        try:
            yield
        finally:
            self._sp_view_depth -= 1
            acc.__class__ = base
            module.gather, module.gather_object = saved["gather"], saved["gather_object"]

    def training_step(self, *args, **kwargs):
        with self._sp_dp_view():
            return super().training_step(*args, **kwargs)

    def _generate_and_score_completions(self, *args, **kwargs):
        with self._sp_dp_view():
            return super()._generate_and_score_completions(*args, **kwargs)

    def compute_loss(self, *args, **kwargs):
        with self._sp_dp_view():
            return super().compute_loss(*args, **kwargs)


class SPGRPOTrainer(OnlineRLSPMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with sequence parallelism over ``args.sp_size`` ranks; ``sp_size=1`` is exactly TRL."""


class SPRLOOTrainer(OnlineRLSPMixin, trl.RLOOTrainer):
    """``trl.RLOOTrainer`` with sequence parallelism over ``args.sp_size`` ranks; ``sp_size=1`` is exactly TRL."""
