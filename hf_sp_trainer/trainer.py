"""``SPTrainer``: ``transformers.Trainer`` with Ulysses sequence parallelism.

The SP behaviour lives in ``SequenceParallelMixin`` (shared with ``SPSFTTrainer``) and touches few hooks:
- data: every rank of an SP group loads the same batch (the sampler shards over DP ranks only);
- inputs: each batch is checked, given ``shift_labels``, padded to a multiple of ``sp_size`` and sliced per rank;
- loss: token-weighted over the whole optimizer step (``num_items_in_batch`` counted once per SP group), so the loss
  and the gradients equal the single-process ones; eval losses are averaged over the group's tokens;
- metrics: predictions are gathered back along the sequence and over DP ranks only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from torch import nn

from .attention import UlyssesAttention, all_gather_along, validate_model_for_sp
from .backends.cpu import drop_cpu_fsdp_mesh, enable_cpu_fsdp, wants_cpu_backend
from .collators import SPDataCollator
from .memory import enable_memory_features, fused_loss_inputs
from .sharding import IGNORE_INDEX, prepare_sp_batch
from .topology import SPTopology, sp_topology


def _unwrap(model: nn.Module) -> transformers.PreTrainedModel:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _pad_token_id(model: nn.Module, processing_class: Any) -> int:
    for source in (processing_class, getattr(processing_class, "tokenizer", None), _unwrap(model).config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


class SequenceParallelMixin:
    """Ulysses SP for a ``transformers.Trainer`` subclass; a no-op when ``args.sp_size == 1``."""

    sp: SPTopology | None = None

    # -- construction ---------------------------------------------------------------------------------------------
    def _sp_check_and_default_collator(self, model, args, data_collator, processing_class):
        """Checks that need no communication (so they fail on every rank alike), and the default collator."""
        sp_size = getattr(args, "sp_size", 1)
        if sp_size == 1:
            return data_collator
        if model is None:
            raise ValueError("SPTrainer with sp_size > 1 needs a model instance (model_init is not supported).")
        validate_model_for_sp(_unwrap(model), sp_size)
        if data_collator is None:
            pad_token_id = _pad_token_id(model, processing_class)
            data_collator = SPDataCollator(pad_to_multiple_of=sp_size, pad_token_id=pad_token_id)
        return data_collator

    def _sp_enable(self) -> None:
        """After ``Trainer.__init__``: SP groups and Ulysses attention (sp_size > 1), then the memory features."""
        if getattr(self.args, "sp_size", 1) > 1:
            self._sp_attach()
        enable_memory_features(self)

    def _sp_attach(self) -> None:
        sp_size = self.args.sp_size
        model = _unwrap(self.model)
        validate_model_for_sp(model, sp_size)
        if self.args.label_smoothing_factor or self.compute_loss_func is not None or not self.model_accepts_loss_kwargs:
            raise ValueError(
                f"sp_size={sp_size} computes the exact loss from pre-shifted `shift_labels` and the step's "
                "`num_items_in_batch`; label_smoothing_factor, a custom compute_loss_func, or a model whose forward "
                "takes no loss kwargs are not supported with sequence parallelism yet."
            )
        self.sp = sp_topology(sp_size)
        kernel = self.args.sp_attn_implementation or model.config._attn_implementation
        self.ulysses = UlyssesAttention(self.sp.sp_group, kernel)
        self.ulysses.attach(model)
        self._sp_pad_id = _pad_token_id(model, self.processing_class)

    def create_accelerator_and_postprocess(self):
        cpu_fsdp = wants_cpu_backend(self.args) == "fsdp"
        if cpu_fsdp:
            drop_cpu_fsdp_mesh(self.args)
        super().create_accelerator_and_postprocess()
        if cpu_fsdp:
            enable_cpu_fsdp(self)

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
        shard.num_processes, shard.process_index = self.sp.dp_size, self.sp.dp_rank
        if self.sp.dp_size == 1 and isinstance(shard, BatchSamplerShard):
            # One SP group sees every batch, so the last one needs no completing with repeated samples (which a
            # packed row would mix into its loss): exactly the single-process batches.
            shard.even_batches = False
        return dataloader

    def get_train_dataloader(self):
        return self._sp_shard_over_dp(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._sp_shard_over_dp(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._sp_shard_over_dp(super().get_test_dataloader(test_dataset))

    def get_total_train_batch_size(self, args) -> int:
        if self.sp is None:
            return super().get_total_train_batch_size(args)
        return self._train_batch_size * args.gradient_accumulation_steps * self.sp.dp_size

    # -- inputs and loss ------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.sp is not None and torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch / self.sp.sp_size  # each SP rank counted its group's batch
        return batch_samples, num_items_in_batch

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = super()._prepare_inputs(inputs)
        if self.sp is None:
            return inputs
        return prepare_sp_batch(inputs, self.sp.sp_rank, self.sp.sp_size, self._sp_pad_id)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = fused_loss_inputs(self, model, inputs, return_outputs)  # memory stack: fused LM-head loss if enabled
        if self.sp is None or model.training or "shift_labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # Evaluation: the batch's loss is the mean over its tokens, i.e. over the whole SP group, as on one device
        # (``num_items_in_batch``, counted over every rank, would mix the batches of different DP ranks).
        group = self.sp.sp_group
        count = (inputs["shift_labels"] != IGNORE_INDEX).sum()
        dist.all_reduce(count, group=group)
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch=count.clamp(min=1))
        loss, outputs = result if return_outputs else (result, None)
        if self.args.average_tokens_across_devices:  # undo the DDP compensation: this loss is not backpropagated
            loss = loss / (self.accelerator.num_processes // self.get_tp_size())
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=group)
        return (loss, outputs) if return_outputs else loss

    # -- evaluation -----------------------------------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self._sp_prediction_loss_only = prediction_loss_only  # memory stack: no logits needed -> fused loss
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if self.sp is not None:  # back to full sequences (padded to a multiple of sp_size)
            logits, labels = (self._sp_gather_sequence(x) for x in (logits, labels))
        return loss, logits, labels

    def _sp_gather_sequence(self, x):
        if x is None:
            return None
        if isinstance(x, (tuple, list)):
            return type(x)(self._sp_gather_sequence(t) for t in x)
        return all_gather_along(x, 1, self.sp.sp_group) if x.ndim >= 2 else x

    def evaluation_loop(self, *args, **kwargs):
        if self.sp is not None:  # the Trainer resets gather_function at the end of every loop
            self.gather_function = self._sp_gather_for_metrics
        return super().evaluation_loop(*args, **kwargs)

    def _sp_gather_for_metrics(self, tensor: torch.Tensor) -> torch.Tensor:
        """``accelerator.gather_for_metrics`` over DP ranks: one copy per SP group, last-batch duplicates dropped."""
        per_rank = self.accelerator.gather(tensor).chunk(self.sp.world_size)
        gathered = torch.cat(per_rank[:: self.sp.sp_size])
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            gathered = gathered[: state.remainder]
        return gathered


class SPTrainer(SequenceParallelMixin, transformers.Trainer):
    """``transformers.Trainer`` with Ulysses sequence parallelism over ``args.sp_size`` ranks.

    With ``sp_size == 1`` it is exactly ``Trainer``. With ``sp_size > 1`` the model's attention runs through the
    Ulysses backend, examples are packed with ``position_ids`` (``SPDataCollator``) unless a collator is given, each
    SP group consumes one batch per micro-step, and loss, gradients and ``eval_loss`` equal the single-process ones.
    """

    def __init__(self, model=None, args=None, data_collator=None, *extra, **kwargs):
        processing_class = kwargs.get("processing_class")
        if processing_class is None and len(extra) > 2:
            processing_class = extra[2]
        data_collator = self._sp_check_and_default_collator(model, args, data_collator, processing_class)
        super().__init__(model, args, data_collator, *extra, **kwargs)
        self._sp_enable()


__all__ = ["SPTrainer", "SequenceParallelMixin"]
