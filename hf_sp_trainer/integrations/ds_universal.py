"""DeepSpeed ZeRO checkpoints on another world size: DeepSpeed's universal checkpoint (``trainers/resume.py``).

A ZeRO checkpoint holds each rank's partition of the flat fp32 weights and optimizer state; DeepSpeed's own loader
reads it only on the world size that wrote it. ``ds_to_universal`` rewrites it per parameter (``zero/<name>/fp32.pt,
exp_avg.pt, ...``), which the engine loads on any world size when its config has ``checkpoint.load_universal``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil

import torch
import torch.distributed as dist
from transformers.utils import logging

logger = logging.get_logger(__name__)

UNIVERSAL_LATEST = "latest_universal"  # DeepSpeed's pointer to the universal checkpoint's folder (its tag)


def universal_checkpoint(checkpoint: str) -> str:
    """Convert the ZeRO checkpoint in ``checkpoint`` (its ``latest`` tag) to DeepSpeed's universal format, once:
    ``<tag>_universal`` beside the tag's folder, named by ``latest_universal``. Returns that folder."""
    with open(os.path.join(checkpoint, "latest")) as f:
        tag = f.read().strip()
    out = os.path.join(checkpoint, f"{tag}_universal")
    latest = os.path.join(checkpoint, UNIVERSAL_LATEST)
    if os.path.isdir(out) and os.path.isfile(latest):
        with open(latest) as f:
            if f.read().strip() == os.path.basename(out):  # written last: the conversion finished
                return out
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    partial = out + ".partial"
    for stale in (partial, out):
        shutil.rmtree(stale, ignore_errors=True)
    args = argparse.Namespace(  # paths relative to the checkpoint: DeepSpeed matches its temporary files' paths
        input_folder=tag,  # as regular expressions, which a "+" or "(" in the checkpoint's path would break
        output_folder=os.path.basename(partial),
        num_extract_workers=1,  # in this process: no worker processes
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # DeepSpeed writes the universal-checkpoint info only for some models
    )
    cwd = os.getcwd()
    try:
        os.chdir(checkpoint)
        with contextlib.redirect_stdout(io.StringIO()) as printed, contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal(args)
    finally:
        os.chdir(cwd)
    logger.info(printed.getvalue())
    os.replace(partial, out)
    with open(latest + ".tmp", "w") as f:
        f.write(os.path.basename(out))
    os.replace(latest + ".tmp", latest)
    return out


def use_universal_checkpoint(trainer, checkpoint: str) -> None:
    """The checkpoint converted on the main process (every rank waits), and DeepSpeed told to load the universal one
    (``checkpoint.load_universal``, read when the engine is built in ``train``)."""
    error = None
    if trainer.args.process_index == 0:
        try:
            out = universal_checkpoint(checkpoint)
            logger.warning(f"Converted the ZeRO checkpoint of {checkpoint} to a universal checkpoint: {out}")
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = exc
    failed = [error is not None]
    if dist.is_initialized():
        dist.broadcast_object_list(failed, src=0)
    if failed[0]:
        raise RuntimeError(f"Converting {checkpoint} to a DeepSpeed universal checkpoint failed: {error!r}") from error
    trainer._sp_universal_checkpoint = True
    plugin = trainer.accelerator.state.deepspeed_plugin
    for config in {id(c): c for c in (plugin.deepspeed_config, plugin.hf_ds_config.config)}.values():
        config.setdefault("checkpoint", {})["load_universal"] = True


def restore_param_groups(trainer, checkpoint: str | None) -> None:
    """After a universal checkpoint was loaded under ZeRO-3, two repairs of DeepSpeed's loader (0.19.8, ``DeepSpeed
    ZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``): it gives every param group the first
    one's hyperparameters (the no-decay group would decay) and one shared ``step`` tensor (torch's Adam increments it
    in place once per group: every group's bias correction would count all groups' steps)."""
    if checkpoint is None or not getattr(trainer, "_sp_universal_checkpoint", False):
        return
    zero_optimizer = trainer.model_wrapped.optimizer
    if trainer.accelerator.state.deepspeed_plugin.zero_stage != 3:
        return  # ZeRO-1/2's universal loader restores each group's own
    with open(os.path.join(checkpoint, UNIVERSAL_LATEST)) as f:
        folder = os.path.join(checkpoint, f.read().strip())
    state = torch.load(os.path.join(folder, "zero", "optimizer_state.pt"), map_location="cpu", weights_only=False)
    saved_groups = state["optimizer_state_dict"]["param_groups"]
    groups = zero_optimizer.optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise RuntimeError(f"{folder}: {len(saved_groups)} saved optimizer param groups, {len(groups)} here")
    for group, saved in zip(groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for state in zero_optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


__all__ = ["restore_param_groups", "universal_checkpoint", "use_universal_checkpoint"]
