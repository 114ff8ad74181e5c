"""FSDP2 and DeepSpeed ZeRO on CPU-only machines (gloo).

accelerate selects FSDP and DeepSpeed only on accelerator devices: on a CPU-only machine a run asking for either
silently becomes plain DDP (FSDP) or a single process (DeepSpeed). torch's FSDP2 and DeepSpeed's ZeRO both run over
gloo, so when the run is distributed and no accelerator is present, this module sets the distributed state up in two
phases: ``bring_up`` when the training arguments set up their devices (gloo, and accelerate's state typed for the
backend, handed over with ``use_configured_state``), and ``accelerator_setup`` around the trainer's accelerator
creation (the FSDP2 plugin). The training then goes through accelerate's own FSDP2 and DeepSpeed code paths. Nothing
changes when a GPU is present.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist


def _is_distributed_launch() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def wants_cpu_backend(args) -> str | None:
    """``"deepspeed"`` or ``"fsdp"`` when ``args`` ask for that backend in a distributed CPU-only run, else None."""
    if torch.cuda.is_available() or not _is_distributed_launch():
        return None
    if args.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    if args.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    return None


def bring_up(args) -> None:
    """Phase 1, when ``args`` set up their devices: if they ask for FSDP2 or DeepSpeed on a distributed CPU-only run,
    start gloo and accelerate's state typed for that backend (DeepSpeed's ZeRO-3 ``zero.Init`` needs it before any
    model is built). Otherwise nothing."""
    backend = wants_cpu_backend(args)
    if backend is None:
        return
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(reset_partial_state=True)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=args.ddp_timeout_delta)
    state = PartialState(cpu=True, backend="gloo")
    if backend == "deepspeed":
        import deepspeed.comm

        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        state.distributed_type = DistributedType.DEEPSPEED
        args.use_cpu = False  # accelerate's DeepSpeed path is skipped for `cpu=True`; the device stays the CPU
    args.accelerator_config.use_configured_state = True


@contextlib.contextmanager
def accelerator_setup(trainer):
    """Phase 2, around ``Trainer.create_accelerator_and_postprocess``: accelerate attaches an FSDP plugin only on
    accelerator devices, so on CPU the run is switched to accelerate's FSDP2 path once the accelerator exists."""
    fsdp = wants_cpu_backend(trainer.args) == "fsdp"
    if fsdp:
        _drop_fsdp_mesh(trainer.args)
    yield
    if fsdp:
        _enable_fsdp(trainer)


def _drop_fsdp_mesh(args) -> None:
    """accelerate validates a ``ParallelismConfig`` before the run is switched to FSDP2; a 1-D ``dp_shard`` mesh over
    every rank is FSDP2's default mesh, so it is dropped. Hybrid sharding (``dp_replicate_size > 1``) needs GPUs."""
    config = args.parallelism_config
    if config is None:
        return
    if config.dp_replicate_size > 1 or config.tp_size > 1 or config.cp_size > 1:
        raise ValueError(
            f"On a CPU-only machine FSDP2 shards over all ranks; dp_replicate_size={config.dp_replicate_size}, "
            f"tp_size={config.tp_size}, cp_size={config.cp_size} need accelerate's GPU path. Use dp_shard_size only."
        )
    args.parallelism_config = None


def _enable_fsdp(trainer) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return
    plugin_args = trainer.args.fsdp_plugin_args
    plugin = FullyShardedDataParallelPlugin(**plugin_args) if plugin_args else FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ValueError(
            f"FSDP on CPU runs with FSDP2 only (fsdp_version={plugin.fsdp_version}): set "
            "fsdp_config={'fsdp_version': 2, ...}."
        )
    args = trainer.args
    if args.bf16 or args.fp16:  # FSDP2's MixedPrecisionPolicy: low-precision parameters and compute
        plugin.set_mixed_precision("bf16" if args.bf16 else "fp16")
    # Both states: every `AcceleratorState()` call copies the partial state's type over its own.
    PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True


def already_there(tensor: torch.Tensor, device: torch.device) -> bool:
    """``tensor`` needs no move to ``device``: both on the CPU. accelerate gives a distributed CPU run the device
    ``cpu:0``, and torch copies a CPU tensor on ``.to("cpu:0")`` (its own device is ``cpu``, no index): every batch
    was copied by the data loader (whose look-ahead kept the original alive) and again by the Trainer's input
    preparation (a long multimodal row's pixels: three storages at the step's start at sp 2, two at sp 1)."""
    return tensor.device.type == "cpu" and torch.device(device).type == "cpu"
