"""``SPGRPOTrainer`` / ``SPRLOOTrainer``: TRL's online RL trainers with sequence parallelism (docs/grpo.md).

Generation runs without SP, with transformers' ``generate`` or TRL's colocated vLLM engine (``rollouts``): every rank
of an SP group draws the group's completions and the first rank's are kept (``replicate``), or each draws 1/sp of
them, gathered over the group (``split``). Scoring prompt+completion (policy, old policy, reference)
runs sequence-parallel through the preference hooks (exact per-token log-probs / entropies, and an MoE policy's router
aux loss, on every SP rank). TRL's gathers, advantage slicing and normalisers see a data-parallel view of the
accelerator (one copy per SP group): the trainer's ``accelerator`` is a view during TRL's step code (the accelerator
itself is not modified), and TRL's module-level ``gather`` / ``gather_object`` go through the patch registry.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import transformers
import trl

from ..memory import MemoryArguments
from ..model.decoder import unwrap_peft
from . import rollouts, vllm_server
from .arguments import SequenceParallelArguments
from .dp_view import dp_accelerator_view, gathers_per_group, patch_trl_gathers
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
            "rank; sampled completions come from other random streams than TRL's, greedy ones are the same; with "
            "use_vllm each completion is drawn with its own seed, so the same ones at every sp_size). With vLLM's "
            "server mode under SP the server draws each group's completions once, with those per-row seeds."
        },
    )
    vllm_engine_kwargs: dict | None = field(
        default=None,
        metadata={
            "help": "use_vllm, colocate mode: extra keyword arguments for the vllm.LLM engine TRL builds (for example "
            "{'enforce_eager': True} or {'dtype': 'float32'}), over TRL's own."
        },
    )
    vllm_server_weight_sync: str = field(
        default="auto",
        metadata={
            "help": "use_vllm, server mode: how the trained weights reach the server. 'nccl': TRL's weight transfer "
            "(CUDA); 'files': safetensors written to vllm_server_weight_dir, which the server reloads (no NCCL: the "
            "server must run in development mode, as `trl vllm-serve` starts it, and see the directory); 'auto': "
            "'nccl' where the trainer has CUDA, 'files' otherwise."
        },
    )
    vllm_server_weight_dir: str | None = field(
        default=None,
        metadata={"help": "vllm_server_weight_sync='files': the directory (default: <output_dir>/vllm-weights)."},
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
        if self.sp_size == "auto":
            raise ValueError(
                f"sp_size='auto' is not available for {type(self).__name__}: TRL's generation-batch arithmetic counts "
                "the data-parallel ranks when the config is built, before the trainer can plan. Set sp_size to an "
                "integer (hf-sp-plan --gpus N prints what fits)."
            )
        self._sp_dp_world = True
        try:
            post_init()
        finally:
            self._sp_dp_world = False
        if self.sp_generation not in SP_GENERATION_MODES:
            raise ValueError(f"sp_generation={self.sp_generation!r}: use one of {SP_GENERATION_MODES}.")
        if self.use_vllm:
            check_vllm_options(self)
        if self.sp_size > 1:
            refuse(
                {
                    "use_transformers_continuous_batching": getattr(
                        self, "use_transformers_continuous_batching", False
                    ),
                    "use_liger_kernel": getattr(self, "use_liger_kernel", False),
                },
                "generation runs with transformers' generate or vLLM and the loss with TRL's fused log-prob head",
                "Use the default generation and loss, or sp_size=1.",
            )
        self._check_sequence_parallel()


def check_vllm_options(config) -> None:
    """``use_vllm`` under SP: a server, one colocated engine per rank, or one over each SP group (GPU) with ``split``
    generation. Raised from the config, on every rank, before anything collective."""
    if config.vllm_engine_kwargs and config.vllm_mode != "colocate":
        raise ValueError("vllm_engine_kwargs applies to vllm_mode='colocate' (a server takes its own arguments).")
    vllm_server.resolve_weight_sync(config.vllm_server_weight_sync)
    if config.vllm_mode != "server" and (config.vllm_server_weight_dir or config.vllm_server_weight_sync != "auto"):
        raise ValueError(
            f"vllm_server_weight_sync / vllm_server_weight_dir apply to vllm_mode='server', not {config.vllm_mode!r}."
        )
    tp = config.vllm_tensor_parallel_size
    if config.sp_size == 1 or config.vllm_mode != "colocate":
        return
    if tp > 1 and (tp != config.sp_size or config.sp_generation != "split"):
        raise ValueError(
            f"vllm_tensor_parallel_size={tp} with sp_size={config.sp_size}, sp_generation="
            f"{config.sp_generation!r}: an engine with tensor parallelism spans one SP group and draws the group's "
            f"completions once. Set vllm_tensor_parallel_size={config.sp_size} with sp_generation='split', or 1."
        )
    if tp > 1 and rollouts.vllm_available() and rollouts.on_cpu():
        raise ValueError(
            f"vllm_tensor_parallel_size={tp}: vLLM's CPU build runs one engine per process (its tensor parallelism "
            "needs GPUs). Set vllm_tensor_parallel_size=1."
        )


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
        self._seeded_generation_calls = 0
        trl_init = next(c for c in type(self).__mro__ if c.__module__.startswith("trl.")).__init__
        config = inspect.signature(trl_init).bind(self, *args, **kwargs).arguments.get("args")
        vllm_mode = config.vllm_mode if config is not None and config.use_vllm else None
        colocated = vllm_mode == "colocate"
        options = {"colocate": colocated_engine_options, "server": server_options}.get(vllm_mode)
        with options(config) if options is not None else contextlib.nullcontext():
            super().__init__(*args, **kwargs)
        if self.sp is not None:
            if not colocated:
                # TRL seeds each process differently (``seed + process_index``) so that data-parallel ranks sample
                # different completions; the SP ranks of a group are one data-parallel rank and share its seed. (A
                # colocated engine reseeded the process with its seed, the group's data-parallel rank: as TRL's.)
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
        seeds = self._request_seeds(len(prompt_ids))
        if self.args.use_vllm and self.args.vllm_mode == "server" and seeds is not None:
            return self._served_generation(prompt_ids, seeds, *args, **kwargs)
        if self.sp is None:
            with self._seeded(seeds):
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        topo = self.sp.topology
        if self.args.sp_generation == "split" and len(prompt_ids) >= topo.sp_size:
            return self._sp_split_generation(prompt_ids, seeds, *args, **kwargs)
        with self._sp_generation(), self._seeded(seeds):
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        # Every rank generated (RNG streams and any collectives in lock-step); the group's first rank's result wins.
        box = [out]
        dist.broadcast_object_list(box, src=dist.get_global_rank(topo.sp_group, 0), group=topo.sp_group)
        return box[0]

    def _served_generation(self, prompt_ids, seeds, *args, **kwargs):
        """vLLM's server draws each SP group's rows once, each with its seed; every rank gets its group's."""
        if self.sp is not None:
            leader, generating = dist.get_global_rank(self.sp.topology.sp_group, 0), self._sp_generation()
        else:
            leader, generating = (dist.get_rank() if dist.is_initialized() else 0), contextlib.nullcontext()
        with generating, vllm_server.served_requests(self.vllm_generation, seeds, leader):
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def _sp_split_generation(self, prompt_ids, seeds, *args, **kwargs):
        """Each SP rank generates a contiguous 1/sp of the rows (sampling from its own seeded stream, or with vLLM
        each row from its own seed; the global stream left untouched so the ranks stay in step), then the group
        gathers them in order. An engine with tensor parallelism over the group gets the group's rows (TRL gathers
        them over its TP group, the SP group) and their seeds."""
        topo = self.sp.topology
        n, sp = len(prompt_ids), topo.sp_size
        lo, hi = topo.sp_rank * n // sp, (topo.sp_rank + 1) * n // sp
        if seeds is not None and self.args.vllm_tensor_parallel_size == 1:
            seeds = seeds[lo:hi]
        self._sp_generation_calls += 1
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with self._sp_generation(), torch.random.fork_rng(devices=devices), self._seeded(seeds):
            torch.manual_seed(hash((self.args.seed, self._sp_generation_calls, topo.dp_rank, topo.sp_rank)) % 2**63)
            out = super()._generate_single_turn(prompt_ids[lo:hi], *args, **kwargs)
        parts = [None] * sp
        dist.all_gather_object(parts, out, group=topo.sp_group)
        if not isinstance(out, tuple):  # RLOO: the completion ids
            return [c for part in parts for c in part]
        completions = [c for part, _ in parts for c in part]  # GRPO: (completion ids, log-probs or None)
        logprobs = None if any(lp is None for _, lp in parts) else [x for _, lp in parts for x in lp]
        return completions, logprobs

    # -- vLLM: per-request seeds (split generation) --------------------------------------------------------------------
    def _request_seeds(self, n: int) -> list[int] | None:
        """With vLLM and ``sp_generation='split'``, or its server under SP: a seed per row of this data-parallel
        rank's ``n`` (the call counted, the rows' global indices), the same whichever rank of whichever layout draws
        the row."""
        served = self.args.vllm_mode == "server" and self.sp is not None
        if not (self.args.use_vllm and (self.args.sp_generation == "split" or served)):
            return None
        self._seeded_generation_calls += 1
        dp_rank = self.sp.topology.dp_rank if self.sp is not None else self.accelerator.process_index
        rows = range(dp_rank * n, dp_rank * n + n)
        return rollouts.request_seeds(self.args.seed, self._seeded_generation_calls, rows)

    def _seeded(self, seeds: list[int] | None):
        if seeds is None:
            return contextlib.nullcontext()
        return rollouts.seeded_requests(self.vllm_generation.llm, seeds)

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
        try:
            with gathers_per_group(topo):
                yield
        finally:
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


@contextlib.contextmanager
def colocated_engine_options(config):
    """While TRL builds its colocated vLLM engine: our patches installed, ``vllm_engine_kwargs`` passed and, under SP,
    the engine seeded with its SP group's data-parallel rank (TRL seeds it with ``process_index // tp``), the seed
    TRL's process for that rank uses: every rank of the group draws what that process draws."""
    rollouts.install()
    options = dict(config.vllm_engine_kwargs or {})
    if config.sp_size > 1:
        rank = dist.get_rank() if dist.is_initialized() else 0
        options["seed"] = rank // config.sp_size  # SP groups are blocks of contiguous ranks (topology)
    with rollouts.engine_options(**options):
        yield


@contextlib.contextmanager
def server_options(config):
    """While TRL builds its server client: our patches installed and, with ``vllm_server_weight_sync`` resolving to
    files, the weight directory (``vllm_server``)."""
    rollouts.install()
    directory = None
    if vllm_server.resolve_weight_sync(config.vllm_server_weight_sync) == "files":
        directory = config.vllm_server_weight_dir or f"{config.output_dir}/vllm-weights"
    with vllm_server.weight_files(directory):
        yield


class SPGRPOTrainer(OnlineRLSPMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with sequence parallelism over ``args.sp_size`` ranks; ``sp_size=1`` is exactly TRL."""


class SPRLOOTrainer(OnlineRLSPMixin, trl.RLOOTrainer):
    """``trl.RLOOTrainer`` with sequence parallelism over ``args.sp_size`` ranks; ``sp_size=1`` is exactly TRL."""
