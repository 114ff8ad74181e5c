"""``SPTrainer``: ``transformers.Trainer`` with sequence parallelism.

The SP behaviour lives in ``SequenceParallelMixin`` (shared with the TRL trainers) and touches few hooks:
- construction: one path for every trainer class; ``apply_sequence_parallel`` on the model, then the memory stack;
- data: every rank of an SP group loads the same batch (the sampler shards over DP ranks only);
- inputs: ``SequenceParallel.shard_batch`` turns each batch into this rank's shard (the one owner of the layout);
- loss: ``hf_sp_trainer.loss`` (token-weighted over the whole optimizer step, so loss and gradients equal the
  single-process ones);
- metrics: predictions are gathered back along the sequence, in the original order, and over DP ranks only.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from torch import nn
from transformers.trainer_pt_utils import BatchRebalanceSampler
from transformers.utils import logging

from ..collators import SPDataCollator, SPMultimodalCollator
from ..integrations import accelerate_sp, cpu_backend, ds_universal
from ..integrations.memory_budget import KeepBudgetCallback
from ..integrations.throughput import add_throughput_callback, insert_after_default_flow
from ..losses.sequence import check_loss_options, micro_batch_loss, sp_eval_loss
from ..memory import enable_memory_features, loss_only_inputs, resolve_deprecated_flags
from ..memory.checkpointing import KEEP_BUDGET_MARK
from ..mixers.documents import keep_documents_apart
from ..model.decoder import unwrap_peft
from ..model.mixers import has_no_grad_indexers
from ..model.vlm import is_multimodal
from ..parallel import SequenceParallel, apply_sequence_parallel, compile_decoder_layers
from ..topology import release_groups, teardown
from . import auto_sp, preemption, resume
from .rebalance import DocumentRebalanceSampler, rebalanced

logger = logging.get_logger(__name__)


def tell_ddp_of_no_grad_indexers(model: nn.Module, args) -> None:
    """A selecting attention's indexer (DSA, block / query-sparse, DeepSeek-V4's) runs without autograd in
    transformers, so its parameters never get a gradient. Under activation checkpointing transformers leaves DDP's
    ``find_unused_parameters`` off, and DDP then stops at the second step ("Expected to have finished reduction");
    so, unless the user set ``ddp_find_unused_parameters``, it is switched on for such a model (every SP run is
    DDP-wrapped: the gradient sum over the SP group)."""
    if args.ddp_find_unused_parameters is None and has_no_grad_indexers(unwrap_peft(model)):
        args.ddp_find_unused_parameters = True
        logger.info("ddp_find_unused_parameters=True: the model's selection indexers get no gradient (no_grad).")


def pad_token_id(model: nn.Module, processing_class: Any) -> int:
    for source in (processing_class, getattr(processing_class, "tokenizer", None), unwrap_peft(model).config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


class SequenceParallelMixin:
    """Sequence parallelism for a ``transformers.Trainer`` subclass. At ``args.sp_size == 1`` only the data is as
    under SP: the same default collator (ragged rows packed), and a hybrid model's linear / SSM / conv layers keep
    packed documents apart.

    Subclasses override ``sp_default_collator`` (the collator used when none is given) and ``sp_after_init`` (what the
    base trainer's own construction needs adjusting for SP); everything else is shared.
    """

    sp: SequenceParallel | None = None
    sp_plan: auto_sp.SPPlan | None = None  # sp_size="auto": the planner's choice (planner.auto.SPPlan)

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        model, training_args = bound.arguments.get("model"), bound.arguments.get("args")
        self.sp_plan = auto_sp.resolve(self, bound)  # sp_size="auto": the planner's int, before anything reads it
        sp_size = getattr(training_args, "sp_size", 1)
        if sp_size > 1 and model is None:
            raise ValueError("Sequence parallelism (sp_size > 1) needs a model; model_init is not supported.")
        if bound.arguments.get("data_collator") is None:  # at every sp_size: sp_size alone never changes the data
            collator = self.sp_default_collator(bound.arguments.get("processing_class"))
            if collator is not None and isinstance(model, nn.Module) and is_multimodal(unwrap_peft(model)):
                collator = SPMultimodalCollator(unwrap_peft(model))  # per-document positions, media
            bound.arguments["data_collator"] = collator
        if training_args is not None:  # TRL's activation_offloading means ours (checkpoint_offloading), as it did
            resolve_deprecated_flags(training_args)
            if isinstance(model, nn.Module):  # before the accelerator is built (TRL may get a hub id: no indexer)
                tell_ddp_of_no_grad_indexers(model, training_args)
        super().__init__(*bound.args, **bound.kwargs)
        teardown.register_exit_hook()  # a script that ends without trainer.end() still exits cleanly (sp_size 1 too)
        check_loss_options(self)  # sp_size > 1 and fused_loss compute the model's own loss exactly
        if sp_size > 1:
            self.sp_after_init()
            self.sp = apply_sequence_parallel(
                unwrap_peft(self.model),
                sp_size,
                ring_size=self.args.sp_ring_size,
                attn_implementation=self.args.sp_attn_implementation,
                state_passing=self.args.sp_state_passing,
                split_media=self.args.sp_split_media,
            )
            self._sp_pad_id = pad_token_id(self.model, self.processing_class)
            if self.args.torch_compile:  # the decoder layers, not the whole model (see create_accelerator_...)
                compile_decoder_layers(self.model, self.args.torch_compile_backend, self.args.torch_compile_mode)
            if self.args.sp_throughput_logging:
                add_throughput_callback(self)  # after DefaultFlowCallback: report_to integrations see the figures
        else:  # hybrid models keep packed documents apart at sp_size 1 too: the same training at every sp_size
            keep_documents_apart(unwrap_peft(self.model))
        topology = self.sp.topology if self.sp is not None else None
        enable_memory_features(
            self.model,
            self.args,
            lm_loss_fused=self.sp_fuses_lm_loss,
            ring_size=topology.ring_size if topology else 1,
            ulysses_size=topology.ulysses_size if topology else 1,
        )
        keep = getattr(self.model, KEEP_BUDGET_MARK, None)
        if keep is not None:  # checkpoint_policy="auto": the steps' peaks reach the model's budget
            insert_after_default_flow(self, KeepBudgetCallback(keep))

    # -- hooks for subclasses -------------------------------------------------------------------------------------
    sp_fuses_lm_loss = False  # True where the base trainer already computes its LM loss without full logits
    sp_shards_batch = True  # False where the model shards inside its forward (the preference trainers' hooks)

    def sp_default_collator(self, processing_class: Any):
        """The collator used when none is given, at every ``sp_size`` (ragged rows train at ``sp_size=1`` as under SP):
        one packed row per batch (``None``: the base trainer's own)."""
        return SPDataCollator()

    def sp_after_init(self) -> None:
        """Adjust what the base trainer built in ``__init__`` for SP (before the model is made sequence-parallel)."""

    def sp_loss_scaled_by_world(self) -> bool:
        """Whether the base trainer's ``compute_loss``, given ``num_items_in_batch``, multiplies the loss by the
        number of processes (``Trainer``: only for models that take the loss kwargs)."""
        accepts = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        return bool(self.args.average_tokens_across_devices and accepts)

    def create_accelerator_and_postprocess(self):
        # accelerate reads its PARALLELISM_CONFIG_* variables here: an SP request among them is ours (the configs
        # routed it to sp_size without touching the environment)
        accelerate_sp.apply_environ(self.args)
        with cpu_backend.accelerator_setup(self):  # FSDP2 / DeepSpeed over gloo on CPU-only machines
            super().create_accelerator_and_postprocess()
        if getattr(self.args, "sp_size", 1) > 1 and self.args.torch_compile:
            from accelerate.utils import DynamoBackend

            # SP compiles the decoder layers itself: the per-forward document layout stays outside the graph
            self.accelerator.state.dynamo_plugin.backend = DynamoBackend.NO

    # -- data -----------------------------------------------------------------------------------------------------
    def _sp_shard_over_dp(self, dataloader):
        """Make a prepared dataloader shard over DP ranks only: the ranks of an SP group get the same batches."""
        if self.sp is None:
            return dataloader
        if isinstance(getattr(dataloader, "batch_sampler", None), BatchSamplerShard):
            shard = dataloader.batch_sampler
        elif isinstance(getattr(dataloader, "dataset", None), IterableDatasetShard):
            shard = dataloader.dataset
        else:
            raise ValueError(
                f"Can't shard {type(dataloader).__name__} over data-parallel ranks only. With sp_size > 1 use a "
                "map-style or iterable dataset without `dispatch_batches` (accelerator_config={'dispatch_batches': "
                "False})."
            )
        topo = self.sp.topology
        if dataloader.device is not None and dataloader.device.type == "cpu":
            dataloader.device = None  # already there: no copy of every batch (cpu_backend.already_there)
        rank_aware = getattr(shard, "batch_sampler", None)
        if isinstance(rank_aware, BatchRebalanceSampler):  # yields this rank's batches already: no resharding
            if not isinstance(rank_aware, DocumentRebalanceSampler):  # split over the world: SP groups would diverge
                raise ValueError(
                    f"{type(self).__name__} got a {type(rank_aware).__name__} that splits batches over all "
                    f"{topo.world_size} ranks; with sp_size={topo.sp_size} the ranks of an SP group must load the same "
                    "rows. Use train_sampling_strategy='batch_rebalance' with the SP trainer's own sampler "
                    "(hf_sp_trainer.trainers.rebalance.DocumentRebalanceSampler)."
                )
            return dataloader
        shard.num_processes, shard.process_index = topo.dp_size, topo.dp_rank
        if topo.dp_size == 1 and isinstance(shard, BatchSamplerShard):
            # One SP group sees every batch, so the last one needs no completing with repeated samples (which a
            # packed row would mix into its loss): exactly the single-process batches.
            shard.even_batches = False
        return dataloader

    def _get_train_sampler(self, train_dataset=None):
        """``train_sampling_strategy="batch_rebalance"`` with SP, or with rows packed by ``SPDataCollator``: the same
        steps' examples, balanced over the DP ranks by the cost of packed rows (``rebalance.DocumentRebalanceSampler``)
        instead of over all ranks by the cost of padded ones."""
        sampler = super()._get_train_sampler(train_dataset)
        packed = self.sp is not None or isinstance(self.data_collator, SPDataCollator)
        if packed and isinstance(sampler, BatchRebalanceSampler):
            dataset = train_dataset if train_dataset is not None else self.train_dataset
            sampler = rebalanced(self, sampler, dataset)
        return sampler

    def get_train_dataloader(self):
        return self._sp_shard_over_dp(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._sp_shard_over_dp(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._sp_shard_over_dp(super().get_test_dataloader(test_dataset))

    def get_total_train_batch_size(self, args) -> int:
        if self.sp is None:
            return super().get_total_train_batch_size(args)
        return self._train_batch_size * args.gradient_accumulation_steps * self.sp.topology.dp_size

    # -- inputs and loss ------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.sp is not None and torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch / self.sp.topology.sp_size  # each SP rank counted its group's batch
        return batch_samples, num_items_in_batch

    def _prepare_input(self, data: Any) -> Any:
        if self.sp is not None and torch.is_tensor(data) and cpu_backend.already_there(data, self.args.device):
            if not (self.is_deepspeed_enabled and data.is_floating_point()):  # DeepSpeed casts float inputs
                return data
        return super()._prepare_input(data)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = super()._prepare_inputs(inputs)
        if self.sp is None or not self.sp_shards_batch:
            return inputs
        return self.sp.shard_batch(inputs, self._sp_pad_id)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.sp is None or "shift_labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not model.training:
            return sp_eval_loss(self, super().compute_loss, model, inputs, return_outputs)
        if not self.model_accepts_loss_kwargs:  # e.g. Qwen-VL: the Trainer averages per micro-batch
            return micro_batch_loss(self, super().compute_loss, model, inputs, return_outputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    # -- evaluation -----------------------------------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if prediction_loss_only:
            inputs = loss_only_inputs(model, inputs)  # memory stack: the fused loss needs no logits
        if self.sp is not None:  # MoE: per-token router logits are [b * s/P, experts], not gathered along the sequence
            defaults = getattr(unwrap_peft(model).config, "keys_to_ignore_at_inference", [])
            ignore_keys = [*(defaults if ignore_keys is None else ignore_keys), "router_logits"]
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if self.sp is not None:  # back to full sequences in the original order (padded to the SP multiple)
            logits, labels = (self._sp_gather_sequence(x) for x in (logits, labels))
        return loss, logits, labels

    def _sp_gather_sequence(self, x):
        if x is None:
            return None
        if isinstance(x, (tuple, list)):
            return type(x)(self._sp_gather_sequence(t) for t in x)
        return self.sp.gather_sequence(x) if x.ndim >= 2 else x

    def evaluation_loop(self, *args, **kwargs):
        if self.sp is not None:  # the Trainer resets gather_function at the end of every loop
            self.gather_function = self._sp_gather_for_metrics
        return super().evaluation_loop(*args, **kwargs)

    def _sp_gather_for_metrics(self, tensor: torch.Tensor) -> torch.Tensor:
        """``accelerator.gather_for_metrics`` over DP ranks: one copy per SP group, last-batch duplicates dropped."""
        if isinstance(tensor, (tuple, list)):
            return type(tensor)(self._sp_gather_for_metrics(t) for t in tensor)
        topo = self.sp.topology
        per_rank = self.accelerator.gather(tensor).chunk(topo.world_size)
        gathered = torch.cat(per_rank[:: topo.sp_size])
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            gathered = gathered[: state.remainder]
        return gathered

    # -- checkpoints: complete ones only, preemption (preemption.py), another layout (resume.py) -------------------
    sp_preempted = False  # the last train() stopped early on a preemption signal (with HF_SP_PREEMPTION_EXIT_CODE=none)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest *complete* checkpoint (preemption.py),
        and a preemption signal (SIGTERM, SIGUSR1) saves the step's checkpoint, stops, then ends the process (75)."""
        resume_from_checkpoint = preemption.resolve_resume(self, resume_from_checkpoint)  # True: the newest complete
        resume_from_checkpoint = resume.prepare_resume(self, resume_from_checkpoint)  # checked before any collective
        return preemption.train(self, super().train, resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint, complete only once its marker is written (after every rank saved its part)."""
        preemption.save_checkpoint(self, super()._save_checkpoint, model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        ds_universal.restore_param_groups(self, checkpoint)  # DeepSpeed ZeRO-3's universal loader: each group's own

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        resume.save_layout(self, output_dir)  # sp_layout.json, inside the checkpoint before trainer_state.json

    def _load_rng_state(self, checkpoint) -> None:
        if not resume.load_shared_rng_state(self, checkpoint):  # another layout: the matching saved rank's state
            super()._load_rng_state(checkpoint)

    # -- teardown -------------------------------------------------------------------------------------------------
    def end(self):
        """Finish the trackers and destroy the process groups (ours first): every rank, once, at the very end. A script
        that doesn't call it gets the same teardown at exit (``topology.teardown``)."""
        if dist.is_initialized():
            dist.barrier()  # gloo: nobody tears down while a peer still communicates
        release_groups()
        super().end()


class SPTrainer(SequenceParallelMixin, transformers.Trainer):
    """``transformers.Trainer`` with sequence parallelism over ``args.sp_size`` ranks (Ulysses x Ring).

    With ``sp_size == 1`` it is ``Trainer`` with SP's data (without a collator, examples packed as under SP; hybrid
    models' packed documents kept apart) and its checkpoints (complete-marked, resumable on another layout). With
    ``sp_size > 1`` the model's attention runs through the SP backend, examples are packed with ``position_ids``
    (``SPDataCollator``) unless a collator is given, each SP group consumes one batch per micro-step, and loss,
    gradients and ``eval_loss`` equal the single-process ones.
    """


__all__ = ["SPTrainer", "SequenceParallelMixin", "pad_token_id"]
