"""Preemption that loses nothing, and checkpoints that are complete or not there (docs/preemption.md).

While an SP trainer trains, SIGTERM / SIGUSR1 (``HF_SP_PREEMPTION_SIGNALS``) only set a flag; at the end of each
optimizer step (and after each save) the ranks agree on it (an all-reduce MAX), save that step's checkpoint, stop, and
``train()`` ends the process with ``EXIT_REQUEUE`` (75, ``EX_TEMPFAIL``; ``HF_SP_PREEMPTION_EXIT_CODE``). A checkpoint
is complete once ``COMPLETE_MARKER`` is in it, written last, after every rank wrote its part; ``resume_from_checkpoint=
True`` takes the newest complete one, and ``save_total_limit`` rotates complete ones only, after the marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints
from transformers.utils import logging

from ..topology import teardown

logger = logging.get_logger(__name__)

EXIT_REQUEUE = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, the same command may succeed later
COMPLETE_MARKER = "checkpoint_complete.json"
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def signals_from_env() -> tuple[signal.Signals, ...]:
    """``HF_SP_PREEMPTION_SIGNALS`` (default ``SIGTERM,SIGUSR1``; ``TERM`` or ``15`` work too; empty: none)."""
    names = os.environ.get("HF_SP_PREEMPTION_SIGNALS", DEFAULT_SIGNALS)
    return tuple(_signal(n.strip()) for n in names.split(",") if n.strip() and n.strip().lower() != "none")


def _signal(name: str | signal.Signals) -> signal.Signals:
    if isinstance(name, signal.Signals):
        return name
    if name.isdigit():
        return signal.Signals(int(name))
    return signal.Signals[name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()]


def exit_code_from_env() -> int | None:
    """``HF_SP_PREEMPTION_EXIT_CODE`` (default ``EXIT_REQUEUE``; ``none``: don't exit, ``train()`` returns)."""
    value = os.environ.get("HF_SP_PREEMPTION_EXIT_CODE", str(EXIT_REQUEUE)).strip()
    return None if value.lower() in ("", "none") else int(value)


class PreemptionCallback(TrainerCallback):
    """Stops training at the end of the optimizer step during which one of ``signals`` reached any rank, after saving
    that step's checkpoint. The SP trainers add one (unless given one); ``exit_code``: see ``train``."""

    _UNSET: Any = object()

    def __init__(self, signals: tuple[signal.Signals | str, ...] | None = None, exit_code: int | None = _UNSET):
        self.signals = signals_from_env() if signals is None else tuple(map(_signal, signals))
        self.exit_code = exit_code_from_env() if exit_code is self._UNSET else exit_code
        self.received: int | None = None  # the signal this process got (None: none)
        self.stopping = self.preempted = False  # agreed to stop / stopped before max_steps
        self.watching = False  # inside train()
        self._previous: dict[signal.Signals, Any] = {}
        self._saved_step = -1

    # -- signals --------------------------------------------------------------------------------------------------
    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signum  # only a flag: the step, the save and the collectives go on

    def install(self) -> None:
        """Handle ``signals`` (main thread only; a signal someone else handles or ignores stays theirs)."""
        self.received, self.stopping, self.preempted, self._saved_step = None, False, False, -1
        self.watching = True  # on every rank alike: the per-step agreement is a collective
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            current = signal.getsignal(sig)
            if current not in (signal.SIG_DFL, None):
                logger.warning(f"{sig.name} already has a handler ({current!r}): preemption doesn't handle it.")
                continue
            self._previous[sig] = signal.signal(sig, self._handler)
            signal.siginterrupt(sig, False)  # system calls in C code (gloo, file writes) restart, not fail

    def restore(self) -> None:
        """Give the signals back to the handlers they had before ``install``."""
        self.watching = False
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # -- the ranks agree ------------------------------------------------------------------------------------------
    def _agree(self, args) -> bool:
        flag = int(self.received is not None)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            tensor = torch.tensor([flag], device=args.device)  # NCCL: a device tensor; gloo: the CPU
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            flag = int(tensor.item())
        return bool(flag)

    def _stop(self, state, control, save: bool) -> None:
        self.stopping, self.preempted = True, state.global_step < state.max_steps
        control.should_training_stop, control.should_evaluate = True, False
        if save:
            control.should_save = control.should_log = True  # this step's checkpoint, and its loss logged once

    def on_step_end(self, args, state, control, **kwargs):
        if self.watching and not self.stopping and self._agree(args):
            self._stop(state, control, save=True)

    def on_save(self, args, state, control, **kwargs):
        self._saved_step = state.global_step
        if self.watching and not self.stopping and self._agree(args):  # got it during the save: stop now
            self._stop(state, control, save=False)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.stopping and self._saved_step == state.global_step:
            control.should_save = control.should_evaluate = False  # saved already: no second save of the step


def callback_of(trainer) -> PreemptionCallback | None:
    """The trainer's ``PreemptionCallback``: the one given, else a new one (None when no signal is handled)."""
    found = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PreemptionCallback)]
    if found:
        return found[0]
    callback = PreemptionCallback()
    if not callback.signals:
        return None
    trainer.add_callback(callback)
    return callback


def train(trainer, train_fn: Callable, resume_from_checkpoint: Any = None, *args, **kwargs):
    """``train_fn(resume_from_checkpoint, ...)`` (``Trainer.train``) with the signals handled; after a preemption the
    process ends with the callback's ``exit_code``: every exit hook first (the process groups torn down, logs flushed),
    as a finished CLI worker does."""
    callback = callback_of(trainer)
    if callback is None:
        return train_fn(resume_from_checkpoint, *args, **kwargs)
    callback.install()
    try:
        output = train_fn(resume_from_checkpoint, *args, **kwargs)
        trainer.sp_preempted = callback.preempted
        if callback.preempted and callback.exit_code is not None:  # our handlers stay until the very end
            if trainer.is_world_process_zero():
                name = signal.Signals(callback.received).name if callback.received else "a peer's signal"
                logger.warning(
                    f"Preempted ({name}): stopped after step {trainer.state.global_step} and saved its checkpoint; "
                    f"exiting with {callback.exit_code} (requeue; resume from the newest complete checkpoint)."
                )
            teardown.exit_finished_worker(callback.exit_code)
        return output
    finally:
        callback.restore()


# -- complete checkpoints -----------------------------------------------------------------------------------------
def is_complete(checkpoint: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint, COMPLETE_MARKER))


def checkpoints(folder: str) -> list[str]:
    """The ``checkpoint-N`` directories in ``folder``, by step."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m[1]), name) for name in os.listdir(folder) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(folder, name) for _, name in sorted(found) if os.path.isdir(os.path.join(folder, name))]


def last_complete_checkpoint(folder: str) -> str | None:
    """The newest complete checkpoint in ``folder`` (None if there is none)."""
    return next((c for c in reversed(checkpoints(folder)) if is_complete(c)), None)


def resolve_resume(trainer, value: Any) -> Any:
    """``True``: the newest complete checkpoint in ``output_dir`` (``True`` left for ``Trainer`` to refuse when there
    is no checkpoint at all; an error when none is complete). A path is taken as given (a warning if incomplete)."""
    main = trainer.is_world_process_zero()
    if isinstance(value, bool) and value:
        found, last = checkpoints(trainer.args.output_dir), last_complete_checkpoint(trainer.args.output_dir)
        if found and last is None:
            raise ValueError(
                f"No complete checkpoint in {trainer.args.output_dir}: {[os.path.basename(c) for c in found]} have no "
                f"{COMPLETE_MARKER} (an interrupted save, or saved without it). To resume from one anyway, pass its "
                "path as resume_from_checkpoint."
            )
        skipped = [os.path.basename(c) for c in found if last is not None and _step(c) > _step(last)]
        if skipped and main:
            logger.warning(f"Skipping incomplete checkpoint(s) {skipped} (no {COMPLETE_MARKER}: interrupted saves).")
        return last if last is not None else value
    if isinstance(value, str) and os.path.isdir(value) and not is_complete(value) and main:
        logger.warning(f"{value} has no {COMPLETE_MARKER}: it may be incomplete; resuming from it as asked.")
    return value


def _step(checkpoint: str) -> int:
    return int(_CHECKPOINT.match(os.path.basename(checkpoint))[1])


def save_checkpoint(trainer, save_fn: Callable, model, trial) -> None:
    """``save_fn(model, trial)`` (``Trainer._save_checkpoint``) made atomic: the step's directory cleared of a stale
    marker or an interrupted save first, Trainer's rotation held back, then, once every rank is done, the marker and
    the rotation of complete checkpoints."""
    if trial is not None:  # hyperparameter-search trials: Trainer's own save
        return save_fn(model, trial)
    args = trainer.args
    folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    if args.should_save and os.path.isdir(folder):
        if is_complete(folder):  # saved again: incomplete until the marker
            with contextlib.suppress(FileNotFoundError):  # (save_on_each_node on a shared filesystem)
                os.remove(os.path.join(folder, COMPLETE_MARKER))
        else:
            logger.warning(f"Removing {folder}: an interrupted save of this step; saving it again.")
            shutil.rmtree(folder, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()  # nobody writes into the directory before that
    limit = args.save_total_limit
    args.save_total_limit = None  # Trainer's rotation would run before the marker; ours runs after it
    try:
        save_fn(model, trial)
    finally:
        args.save_total_limit = limit
    trainer.accelerator.wait_for_everyone()  # every rank has written its part
    if not args.should_save:
        return
    if limit is not None and os.path.isfile(os.path.join(folder, TRAINING_ARGS_NAME)):
        torch.save(args, os.path.join(folder, TRAINING_ARGS_NAME))  # with its save_total_limit
    callback = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PreemptionCallback)), None)
    write_marker(folder, trainer.state.global_step, args.world_size, bool(callback and callback.stopping))
    rotate(args.output_dir, limit, trainer.state.best_model_checkpoint, folder)


def write_marker(folder: str, global_step: int, world_size: int, preempted: bool) -> None:
    """``COMPLETE_MARKER`` in ``folder``: written to a temporary name, synced, renamed (the directory synced too)."""
    path, record = os.path.join(folder, COMPLETE_MARKER), {"global_step": global_step, "world_size": world_size}
    record |= {"preempted": preempted, "files": sorted(os.listdir(folder))}
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fd = os.open(folder, os.O_RDONLY)  # the rename, on disk
    os.fsync(fd)
    os.close(fd)


def rotate(folder: str, limit: int | None, best: str | None, current: str) -> None:
    """Trainer's ``save_total_limit`` rotation over complete checkpoints only (oldest first, by modification time as
    Trainer does): ``current`` and ``best`` are kept; incomplete directories are neither counted nor deleted."""
    if limit is None or limit <= 0:
        return
    complete = [c for c in sort_checkpoints(folder, use_mtime=True) if is_complete(c)]
    keep = {os.path.basename(c) for c in (current, best) if c} & {os.path.basename(c) for c in complete}
    remaining = len(complete)
    for checkpoint in complete:
        if remaining <= max(limit, len(keep)):
            break
        if os.path.basename(checkpoint) not in keep:
            logger.info(f"Deleting older checkpoint [{checkpoint}] due to args.save_total_limit")
            shutil.rmtree(checkpoint, ignore_errors=True)
            remaining -= 1


__all__ = ["COMPLETE_MARKER", "EXIT_REQUEUE", "PreemptionCallback", "is_complete", "last_complete_checkpoint"]
