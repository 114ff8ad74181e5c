"""``sp_size="auto"`` in the trainers: resolved once, first thing in ``SequenceParallelMixin.__init__``, into the sp
``planner.auto.choose_sp`` picks (after which ``args.sp_size`` is an int and nothing else changes).

Its inputs, the same on every rank:

- the model's config (the model object's, or ``AutoConfig`` of a hub id / path given to a TRL trainer);
- the longest row a rank group trains on at once: ``per_device_train_batch_size x`` (rows per example: 2 for the
  preference trainers' chosen / rejected) the config's ``max_length`` (or ``max_seq_length``) where it sets one,
  else the longest ``input_ids`` of a ``datasets.Dataset`` or a list of rows (the B longest summed: the collator packs
  a batch into one row); else a ``ValueError``;
- the memory stack, dtype, ZeRO stage (DeepSpeed config, ``fsdp``, accelerate's ``parallelism_config``) and LoRA of
  the arguments, as ``planner.Setting`` models them (what it cannot see, e.g. FSDP from an accelerate config file,
  counts as ZeRO-0: a larger sp, never a smaller one);
- the per-rank budget: ``checkpoint_memory_budget`` when set (bytes, or a fraction of the CUDA device), else the
  CUDA device's total memory, else (CPU) host memory (physical or the cgroup's limit) over the local processes; a
  measured budget is the least over the ranks (one all-reduce, every rank, once the inputs above are checked).
"""

from __future__ import annotations

import heapq
import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import logging

from ..memory.checkpointing import _checkpointing_on
from ..memory.keep_budget import budget_bytes
from ..model.decoder import unwrap_peft
from ..planner import Setting
from ..planner.auto import SPPlan, choose_sp, model_shape
from ..planner.sparse import check_setting

logger = logging.get_logger(__name__)
AUTO = "auto"


def parse_sp_size(value: Any) -> int | str:
    """``sp_size`` as given: a positive int, ``"auto"``, or the digits of one (a command line, a YAML file)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(
        f"sp_size={value!r}: give a positive integer (ranks per sequence; 1: no sequence parallelism) or 'auto' (the "
        "smallest sp whose predicted peak fits the device memory, from the model, the longest row and the world size)."
    )


def row_lengths(dataset: Any) -> list[int] | None:
    """Token counts of a tokenized ``datasets.Dataset`` (every row of its table: a selection's upper bound) or list of
    rows, read cheaply; ``None`` for anything else (iterable, untokenized, a custom dataset)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - a TRL dependency
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        if "input_ids" not in dataset.column_names:
            return None
        import pyarrow.compute as pc

        try:
            lengths = pc.list_value_length(dataset.data.column("input_ids")).to_pylist()
        except Exception:  # noqa: BLE001 - not a list column: not measurable cheaply
            return None
        return [n for n in lengths if n is not None]
    if isinstance(dataset, (list, tuple)) and all(isinstance(r, Mapping) and "input_ids" in r for r in dataset):
        return [len(r["input_ids"]) for r in dataset]
    return None


def longest_row(args: Any, train_dataset: Any, rows_per_example: int = 1) -> int:
    """Tokens of the longest batch one rank group trains on at once (see the module's docstring)."""
    rows = args.per_device_train_batch_size * rows_per_example
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return rows * value
    lengths = row_lengths(train_dataset)
    if not lengths:
        where = "set max_length" if hasattr(args, "max_length") else "pass a tokenized datasets.Dataset or list of rows"
        raise ValueError(
            "sp_size='auto' plans from the longest training row, which can't be read from this train_dataset "
            f"(iterable, untokenized or absent): {where}, or set sp_size to an integer (hf-sp-plan prints what fits)."
        )
    return sum(heapq.nlargest(rows, lengths))


def _zero_stage(args: Any) -> int:
    deepspeed = getattr(args, "hf_deepspeed_config", None)
    if deepspeed is not None:
        return int(deepspeed.get_value("zero_optimization.stage", 0) or 0)
    fsdp = {str(getattr(o, "value", o)) for o in (args.fsdp if isinstance(args.fsdp, list) else [args.fsdp])}
    if fsdp & {"full_shard", "hybrid_shard"}:
        return 3
    if fsdp & {"shard_grad_op", "hybrid_shard_zero2"}:
        return 2
    parallelism = getattr(args, "parallelism_config", None)
    return 3 if parallelism is not None and (parallelism.dp_shard_size or 1) > 1 else 0


def setting_from_args(trainer: Any, bound: inspect.BoundArguments) -> Setting:
    """The planner's ``Setting`` of the trainer's arguments (``gpus`` and ``sp`` filled in by ``choose_sp``)."""
    args, model = bound.arguments["args"], bound.arguments.get("model")
    module = model if isinstance(model, nn.Module) else None
    peft = bound.arguments.get("peft_config")
    if peft is None and isinstance(getattr(module, "peft_config", None), dict):
        peft = next(iter(module.peft_config.values()), None)
    checkpointing = _checkpointing_on(args) or bool(getattr(module, "is_gradient_checkpointing", False))
    policy = "sequence_aware" if getattr(args, "checkpoint_policy", "full") == "sequence_aware" else "full"
    dtype = next(module.parameters()).dtype if module is not None else torch.float32
    cuda = args.device.type == "cuda"
    reference = "ref_model" in bound.signature.parameters and peft is None  # TRL copies the policy when not given
    return Setting(
        gpus=args.world_size, sp=1, zero=_zero_stage(args), lora=peft is not None, lora_r=getattr(peft, "r", 16) or 16,
        tiled_mlp=bool(getattr(args, "tiled_mlp", False)),
        fused_loss=bool(getattr(args, "fused_loss", False) or trainer.sp_fuses_lm_loss),
        checkpointing=policy if checkpointing else "none",
        offload=bool(getattr(args, "checkpoint_offloading", False)) and checkpointing and cuda,
        dtype="bf16" if args.bf16 or args.fp16 or dtype in (torch.bfloat16, torch.float16) else "fp32",
        device="cuda" if cuda else "cpu", split_media=bool(getattr(args, "sp_split_media", False)),
        reference_model=reference and not getattr(args, "reference_free", False),
    )  # fmt: skip


def host_memory() -> float:
    """Physical memory, or the cgroup's limit where lower (a container, a Slurm allocation)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return float(total)


def memory_budget(args: Any) -> tuple[float, str]:
    """Bytes one rank may use, and where the figure comes from (see the module's docstring)."""
    if getattr(args, "checkpoint_memory_budget", None) is not None:
        return budget_bytes(args.checkpoint_memory_budget, args.device), "checkpoint_memory_budget"
    if args.device.type == "cuda":
        budget, source = torch.cuda.get_device_properties(args.device).total_memory, "the CUDA device's memory"
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or args.world_size)
        budget, source = host_memory() / local, f"host memory over {local} local process(es)"
    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank gets here: the same figure everywhere
        device = args.device if args.device.type == "cuda" else torch.device("cpu")
        least = torch.tensor([float(budget)], dtype=torch.float64, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        budget, source = least.item(), source + ", the least over the ranks"
    return float(budget), source


def resolve(trainer: Any, bound: inspect.BoundArguments) -> SPPlan | None:
    """``args.sp_size="auto"`` replaced by the planner's choice (logged on the main process); ``None`` otherwise."""
    args = bound.arguments.get("args")
    if getattr(args, "sp_size", 1) != AUTO:
        return None
    model = bound.arguments.get("model")
    if model is None:
        raise ValueError("sp_size='auto' plans from the model: pass model= (model_init is not supported).")
    if isinstance(model, nn.Module):
        config = unwrap_peft(model).config
    else:  # a TRL trainer given a hub id or a path: the config it will load
        from transformers import AutoConfig

        init = getattr(args, "model_init_kwargs", None) or {}
        options = {k: init[k] for k in ("revision", "trust_remote_code", "cache_dir", "token") if k in init}
        config = AutoConfig.from_pretrained(model, **options)
    length = longest_row(args, bound.arguments.get("train_dataset"), getattr(trainer, "sp_rows_per_example", 1))
    try:
        shape = model_shape(config, name=getattr(config, "_name_or_path", "") or config.model_type)
        setting = setting_from_args(trainer, bound)
        setting.validate()
        check_setting(shape, setting)
    except ValueError as exc:
        raise ValueError(f"sp_size='auto' can't plan this run: {exc} Set sp_size to an integer.") from exc
    budget, source = memory_budget(args)
    plan = choose_sp(shape, length, budget, args.world_size, setting)
    args.sp_size = plan.sp
    if args.process_index == 0:
        logger.info(f"sp_size='auto': {plan.describe()}; budget: {source}. Predictions of the memory planner.")
    return plan


__all__ = ["AUTO", "host_memory", "longest_row", "memory_budget", "parse_sp_size", "resolve", "row_lengths"]
