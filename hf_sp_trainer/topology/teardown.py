"""A clean end of every run: the process groups destroyed in order, at exit too, so a finished job exits 0.

Left to interpreter shutdown, gloo's process groups sometimes abort the process after a finished run
(``terminate called without an active exception``, SIGABRT), and the launcher reports the whole job as failed. That
is what ``trainer.end()`` avoids; scripts that end after ``trainer.train()`` (every Hugging Face example) or after
trainer-free SP without ``sp.remove()`` get the same from an exit hook: a barrier bounded in time (nobody tears down
while a peer still communicates; a dead peer does not hang the exit), our SP groups, then the default group. Once
per process, nothing if ``end()`` already did it, and no barrier after an uncaught exception (the failing rank
exits at once, with its traceback and exit code).

Why a finished process aborts: destroying the groups does not end gloo's worker threads while something else still
holds a group (``DistributedDataParallel``'s reducer does, until interpreter shutdown). A worker thread marks a
collective complete, and only afterwards drops its reference to the collective's tensors; when that reference is the
last one of a tensor Python also saw, freeing it takes the GIL. On a busy machine the thread may not run again until
the interpreter is finalizing, where taking the GIL ends the thread (``pthread_exit``) inside C++ code that cannot be
unwound: ``std::terminate``. So the teardown ends by waiting, bounded, until every gloo worker thread of the process
is parked (``settle_comm_threads``): nothing of a collective is left to free after that.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from .. import patches
from ..topology import release_groups

EXIT_BARRIER_TIMEOUT_S = float(os.environ.get("HF_SP_EXIT_BARRIER_TIMEOUT_S", "600"))
SETTLE_TIMEOUT_S = float(os.environ.get("HF_SP_EXIT_SETTLE_TIMEOUT_S", "30"))
COMM_THREAD_NAMES = ("pt_gloo_runloop",)  # ProcessGroupGloo's worker threads (their /proc comm name)
_TASKS = "/proc/self/task"
_state = {"registered": False, "failed": False}


def end_process_groups(barrier: bool = True, timeout_s: float = EXIT_BARRIER_TIMEOUT_S) -> bool:
    """Barrier (bounded by ``timeout_s``), destroy the SP groups, then the default group. Returns whether the groups
    were destroyed (not after a failed or timed-out barrier: a peer is gone or still talking)."""
    if not dist.is_initialized():
        release_groups()
        return True
    if barrier:
        try:
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout_s))
        except Exception:  # noqa: BLE001 - a dead or stuck peer: leave without tearing down what it may still use
            return False
    release_groups()
    dist.destroy_process_group()
    settle_comm_threads()
    return True


def settle_comm_threads(timeout_s: float = SETTLE_TIMEOUT_S, quiet_s: float = 0.02) -> bool:
    """Wait until every gloo worker thread of this process is parked: asleep and not switched in once over
    ``quiet_s`` (the GIL released meanwhile, so a thread waiting for it gets it). Call it only when no collective is
    pending (after a completed barrier): a parked worker then holds nothing of a finished one. Returns whether the
    threads settled within ``timeout_s`` (``True`` with no gloo thread; ``False`` where ``/proc`` is missing and at
    ``timeout_s <= 0``, which turns the wait off: ``HF_SP_EXIT_SETTLE_TIMEOUT_S=0``)."""
    if timeout_s <= 0 or not os.path.isdir(_TASKS):
        return False
    deadline = time.monotonic() + timeout_s
    before = _comm_thread_activity()
    while True:
        time.sleep(quiet_s)
        now = _comm_thread_activity()
        if now == before and all(state == "S" for state, _ in now.values()):
            return True
        if time.monotonic() > deadline:
            return False
        before = now


def _comm_thread_activity() -> dict[str, tuple[str, int]]:
    """Per gloo worker thread (by id): its scheduler state and its context switches so far."""
    activity = {}
    for tid in os.listdir(_TASKS):
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() not in COMM_THREAD_NAMES:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"{_TASKS}/{tid}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            continue
        activity[tid] = (state, switches)
    return activity


def register_exit_hook() -> None:
    """Tear the process groups down at interpreter exit if nobody did (idempotent; call it from every rank)."""
    if os.environ.get("HF_SP_EXIT_HOOK", "1") == "0":  # 0: off (before/after comparisons)
        return
    # Once per process while ours is recorded (a hook someone installed over it since stays theirs); again after an
    # undo (patches.undo_all).
    if patches.find(sys, "excepthook") is None:
        _note_failures()
    if not _state["registered"]:
        _state["registered"] = True
        atexit.register(_at_exit)


def _note_failures() -> None:
    patches.patch(
        sys,
        "excepthook",
        wrap=_noting_failures,
        check=check_hook,
        reason="note an uncaught exception: the exit teardown then skips its barrier (the failing rank exits at once)",
    )


def check_hook(hook) -> None:
    """The installed ``sys.excepthook`` is callable with the exception triple (ours calls it after noting)."""
    if not callable(hook):
        raise TypeError(f"sys.excepthook is {hook!r}, not a function")


def _noting_failures(previous):
    def excepthook(*exc_info):
        _state["failed"] = True
        previous(*exc_info)

    return excepthook


def exit_finished_worker(code: int = 0) -> NoReturn:
    """End a launched worker whose job is done with exit code ``code``: the exit hooks run (ours: the teardown above;
    the trackers' and libraries'), logs and stdio are flushed, then ``os._exit(code)``. That skips only the C++ static
    destructors, where a finished gloo process still aborts now and then (``terminate called without an active
    exception``) after its groups were destroyed, so that the launcher reports a job that saved its model as failed.
    For workers only (``hf-sp-sft`` and the TRL commands, code 0) and a preempted training (``trainers.preemption``,
    code 75 after its checkpoint, opt-out): otherwise a library never ends its caller's process."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _at_exit() -> None:
    if dist.is_initialized():
        end_process_groups(barrier=not _state["failed"])
    elif not _state["failed"]:  # destroyed by trainer.end() or the script: a group may live on in DDP's reducer
        settle_comm_threads()


__all__ = [
    "EXIT_BARRIER_TIMEOUT_S",
    "end_process_groups",
    "exit_finished_worker",
    "register_exit_hook",
    "settle_comm_threads",
]
