"""Resuming a checkpoint on another layout (dp x sp, ulysses x ring, world size): the same training.

- Model, optimizer, scheduler, scaler: DDP's are full tensors and FSDP2's torch DCP shards (resharded on load). ZeRO's
  are per-rank partitions that DeepSpeed loads only on the world size that wrote them: on another one the checkpoint
  is converted once (``deepspeed.checkpoint.ds_to_universal``, main process, every rank waiting) to a universal
  checkpoint inside it (``<tag>_universal``, named by ``latest_universal``), loaded with ``checkpoint.load_universal``.
- Data position: the Trainer skips ``global_step x gradient_accumulation_steps`` batches per data-parallel rank. The
  sampler's order is layout-independent (seeded), each optimizer step takes the next ``dp x per-device batch x
  accumulation`` samples of it, and the loss is token-weighted over the step: the same global batches in the same
  order exactly when that product (the global batch) is unchanged.
- RNG: on the same layout the Trainer's per-rank files. On another one ranks don't correspond (a new rank has no file
  and keeps its fresh seed: one SP group's ranks would draw differently): each rank loads the state of its dp rank's
  first saved rank where dp is unchanged (online RL samples per dp rank), else rank 0's.
- Generation (GRPO / RLOO): completions are drawn per dp rank, so dp must stay; a checkpoint inside a block trained on
  one generation's buffered completions (not saved) is refused; the SP trainers' generation counters are restored.

Each checkpoint gets ``sp_layout.json``; on resume every rank reads and checks it before any collective: another
backend, or a global batch the new layout doesn't reproduce, is a ValueError naming both layouts and the settings
that work. The per-device batch and the accumulation stay the user's to set (they are fixed when the accelerator and
the DeepSpeed config are built, before ``train`` sees the checkpoint, and the per-device batch is the memory knob).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging

from ..integrations import ds_universal

logger = logging.get_logger(__name__)

LAYOUT_NAME = "sp_layout.json"
GENERATION_COUNTERS = ("_sp_generation_calls", "_seeded_generation_calls")  # SPGRPOTrainer's / SPRLOOTrainer's seeds


@dataclass(frozen=True)
class Layout:
    """How a run is laid out: what a checkpoint records and a resume is checked against."""

    world_size: int
    dp_size: int
    sp_size: int
    ring_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    backend: str  # ddp | fsdp1 | fsdp2 | zero1 | zero2 | zero3, "+offload" for DeepSpeed's CPU / NVMe offload

    @property
    def global_batch(self) -> int:
        return self.dp_size * self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def backend_family(self) -> str:
        """What must match between save and resume: DDP, FSDP (1 or 2) or the ZeRO stage; offload may change."""
        return self.backend.partition("+")[0]

    def describe(self) -> str:
        ring = f" (ulysses {self.sp_size // self.ring_size} x ring {self.ring_size})" if self.sp_size > 1 else ""
        return (
            f"dp {self.dp_size} x sp {self.sp_size}{ring} on {self.world_size} processes, {self.backend}, "
            f"per_device_train_batch_size={self.per_device_train_batch_size} x gradient_accumulation_steps="
            f"{self.gradient_accumulation_steps} (global batch {self.global_batch})"
        )

    def replaces(self, other: Layout) -> bool:
        """Whether checkpoint state saved on ``other`` needs this module's handling to load here."""
        return asdict(self) != asdict(other)


def backend_of(trainer) -> str:
    if trainer.is_deepspeed_enabled:
        zero = trainer.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        offload = any(
            (zero.get(key) or {}).get("device", "none") not in ("none", None)
            for key in ("offload_optimizer", "offload_param")
        )
        return f"zero{zero.get('stage', 0)}" + ("+offload" if offload else "")
    if trainer.is_fsdp_enabled:
        return f"fsdp{getattr(trainer.accelerator.state.fsdp_plugin, 'fsdp_version', 1)}"
    return "ddp"


def layout_of(trainer) -> Layout:
    topo = trainer.sp.topology if trainer.sp is not None else None
    sp = topo.sp_size if topo is not None else 1
    world = trainer.args.world_size
    return Layout(
        world_size=world,
        dp_size=world // sp,
        sp_size=sp,
        ring_size=topo.ring_size if topo is not None else 1,
        per_device_train_batch_size=trainer.args.per_device_train_batch_size,
        gradient_accumulation_steps=trainer.args.gradient_accumulation_steps,
        backend=backend_of(trainer),
    )


def save_layout(trainer, output_dir: str) -> None:
    """Write the run's layout into the checkpoint ``output_dir`` (main process; before ``trainer_state.json``), with
    the online-RL trainers' generation counters (the seeds of split / vLLM generation count the calls)."""
    if trainer.args.should_save:
        os.makedirs(output_dir, exist_ok=True)
        counters = {name: getattr(trainer, name) for name in GENERATION_COUNTERS if hasattr(trainer, name)}
        with open(os.path.join(output_dir, LAYOUT_NAME), "w") as f:
            json.dump(asdict(layout_of(trainer)) | {"counters": counters}, f, indent=2)


def read_saved(checkpoint: str) -> tuple[Layout | None, dict]:
    """The layout ``sp_layout.json`` in ``checkpoint`` records (None: no such file), and its generation counters."""
    path = os.path.join(checkpoint, LAYOUT_NAME)
    if not os.path.isfile(path):
        return None, {}
    with open(path) as f:
        saved = json.load(f)
    return Layout(**{f.name: saved[f.name] for f in fields(Layout)}), saved.get("counters", {})


def working_settings(saved: Layout, now: Layout) -> str:
    """The settings under which ``now``'s run trains ``saved``'s global batches: per-device batch x accumulation for
    this dp size, else the dp sizes (and world sizes at this sp) that divide the global batch."""
    per_rank, rest = divmod(saved.global_batch, now.dp_size)
    if rest == 0:
        pairs = [(b, per_rank // b) for b in range(per_rank, 0, -1) if per_rank % b == 0]
        keep = [p for p in pairs if p[0] == now.per_device_train_batch_size]
        shown = ", ".join(f"({b}, {ga})" for b, ga in (keep + [p for p in pairs if p not in keep])[:6])
        return (
            f"With dp {now.dp_size}, set per_device_train_batch_size x gradient_accumulation_steps = {per_rank}: "
            f"(per_device_train_batch_size, gradient_accumulation_steps) in {shown}."
        )
    dps = [d for d in range(1, saved.global_batch + 1) if saved.global_batch % d == 0]
    worlds = ", ".join(str(d * now.sp_size) for d in dps[:8])
    return (
        f"The global batch {saved.global_batch} does not divide over dp {now.dp_size}: use a dp size in {dps[:8]} "
        f"(world sizes {worlds} at sp_size={now.sp_size}), then set per_device_train_batch_size x "
        f"gradient_accumulation_steps = {saved.global_batch} / dp."
    )


def check_layouts(saved: Layout, now: Layout, checkpoint: str, sampled_per_dp_rank: str | None = None) -> None:
    """ValueError (the same on every rank) where ``now`` can't continue ``saved``'s training exactly;
    ``sampled_per_dp_rank``: the trainer that draws each data-parallel rank's samples from its own stream (dp fixed)."""
    head = f"Can't resume {checkpoint} (saved on {saved.describe()}) on {now.describe()}: "
    if sampled_per_dp_rank and saved.dp_size != now.dp_size:
        worlds = ", ".join(f"{saved.dp_size * sp} (sp_size={sp})" for sp in (1, 2, 4, 8))
        raise ValueError(
            head + f"{sampled_per_dp_rank} samples each data-parallel rank's completions from its own random stream "
            f"(seed + dp rank), so dp {saved.dp_size} -> {now.dp_size} would draw other completions. Keep dp "
            f"{saved.dp_size}: world size {worlds}, with the same global batch."
        )
    if saved.backend_family != now.backend_family:
        raise ValueError(
            head + f"it was written by {saved.backend_family}, whose model and optimizer state {now.backend_family} "
            f"doesn't load. Resume with {saved.backend_family} (any dp / sp layout; DeepSpeed's offload may change)."
        )
    if saved.global_batch != now.global_batch:
        raise ValueError(
            head + f"the global batch (dp x per_device_train_batch_size x gradient_accumulation_steps) would change "
            f"from {saved.global_batch} to {now.global_batch}, so the remaining steps would not train the same "
            f"batches. {working_settings(saved, now)}"
        )


def prepare_resume(trainer, resume_from_checkpoint):
    """Before ``Trainer.train``: check the checkpoint's layout against this run's (every rank, no collective), and
    where it differs set up what loads it here (DeepSpeed: the universal checkpoint). Returns the checkpoint path."""
    trainer._sp_saved_layout, trainer._sp_universal_checkpoint = None, False
    checkpoint = resume_from_checkpoint
    if checkpoint is True:  # the output directory's last checkpoint (none: the Trainer raises)
        checkpoint = get_last_checkpoint(trainer.args.output_dir) or True
    if not isinstance(checkpoint, str):
        return checkpoint
    saved, counters = read_saved(checkpoint)
    if saved is None:  # a checkpoint from before this module, or another trainer: the Trainer's own resume
        return checkpoint
    now = layout_of(trainer)
    online_rl = hasattr(trainer.args, "num_generations") and hasattr(trainer.args, "steps_per_generation")
    check_layouts(saved, now, checkpoint, type(trainer).__name__ if online_rl else None)
    for name, value in counters.items():
        setattr(trainer, name, value)
    if not now.replaces(saved):
        return checkpoint
    if online_rl:
        check_generation(trainer, saved, now, checkpoint)
    if trainer.args.process_index == 0:
        logger.warning(f"Resuming {checkpoint} (saved on {saved.describe()}) on {now.describe()}.")
    trainer._sp_saved_layout = saved
    if trainer.is_deepspeed_enabled and saved.world_size != now.world_size:
        ds_universal.use_universal_checkpoint(trainer, checkpoint)
    return checkpoint


def check_generation(trainer, saved: Layout, now: Layout, checkpoint: str) -> None:
    """Online RL on another layout: split generation without vLLM samples each SP rank's share of the completions
    from a stream of its own (another sp_size, other completions); and ``steps_per_generation x num_iterations``
    micro-steps train on one generation's completions, which a checkpoint doesn't hold (resumed inside such a block,
    they would be generated again from another random state)."""
    from transformers.trainer_callback import TrainerState

    args = trainer.args
    if getattr(args, "sp_generation", None) == "split" and not args.use_vllm and saved.sp_size != now.sp_size:
        raise ValueError(
            f"Can't resume {checkpoint} with sp_size {now.sp_size} exactly: sp_generation='split' samples each SP "
            f"rank's share of the completions from its own random stream, so they depend on sp_size. Keep sp_size="
            f"{saved.sp_size} (any ring size), or use vLLM (a seed per completion)."
        )

    step = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json")).global_step
    every = trainer.args.steps_per_generation * getattr(trainer, "num_iterations", 1)
    if (step * saved.gradient_accumulation_steps) % every:
        raise ValueError(
            f"Can't resume {checkpoint} on another layout exactly: it was saved after "
            f"{step * saved.gradient_accumulation_steps} micro-steps, inside a block of {every} (steps_per_generation "
            f"x num_iterations) trained on one generation's completions, which a checkpoint doesn't hold. Resume "
            f"from a checkpoint whose global_step x gradient_accumulation_steps is a multiple of {every}."
        )


def load_shared_rng_state(trainer, checkpoint: str | None) -> bool:
    """On a changed layout (True: done here): where dp is unchanged, the state saved by the first rank of this
    rank's data-parallel rank (its SP group's; online RL draws each dp rank's completions from its own stream), else
    rank 0's, on every rank. On the same layout, False: the Trainer's per-rank files."""
    saved = getattr(trainer, "_sp_saved_layout", None)
    if checkpoint is None or saved is None:
        return False
    now = layout_of(trainer)
    dp_rank = trainer.sp.topology.dp_rank if trainer.sp is not None else trainer.args.process_index
    source = dp_rank * saved.sp_size if saved.dp_size == now.dp_size else 0  # the same dp rank's first rank
    path = os.path.join(checkpoint, "rng_state.pth" if saved.world_size <= 1 else f"rng_state_{source}.pth")
    if not os.path.isfile(path):
        logger.warning(f"No RNG state {path}: the resumed run's random draws are not the uninterrupted run's.")
        return True
    with safe_globals():
        state = torch.load(path, weights_only=True)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    device = trainer.args.device
    if device.type != "cpu" and device.type in state:  # the saving rank's own device's (of all the devices it saw)
        device_state = state[device.type]
        if isinstance(device_state, (list, tuple)):
            device_state = device_state[source % len(device_state)]
        try:
            torch.get_device_module(device.type).set_rng_state(device_state, device)
        except Exception as exc:  # noqa: BLE001 - as the Trainer does: reported, not fatal
            logger.error(f"Couldn't restore the {device.type} RNG state: {exc}")
    return True


__all__ = ["LAYOUT_NAME", "Layout", "check_layouts", "layout_of", "prepare_resume", "read_saved", "save_layout"]
