"""Launched jobs side by side: an e2e test's (or module's) independent launches, two at a time.

A launched job spends seconds in a single process (the launcher importing torch / transformers / TRL, a tiny model
being written, a rank waiting for the other's import) while the second core idles; a second job fills it. Each job is
a callable run in a worker thread that only starts processes and waits on them (no torch work: the thread shares the
test process's RNG and state). A job's return value, or its exception, is its result: ``result()`` re-raises it in
the test that asks for it. Jobs that run concurrently must not share a port: give each launch its own
(``port_flags``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tests.pool import free_port

SIDE_BY_SIDE = 2  # jobs at once on this 2-core machine: a third only queues for the cores


def port_flags(launcher: str) -> list[str]:
    """A free rendezvous port for one launch: ``accelerate`` (``hf-sp-*``) or ``torchrun``."""
    flag = {"accelerate": "--main_process_port", "torchrun": "--master_port"}[launcher]
    return [flag, str(free_port())]


class SideBySide:
    """Jobs started as workers free up, ``SIDE_BY_SIDE`` at a time; ``close()`` waits for every one."""

    def __init__(self, jobs: dict[str, Callable[[], Any]], workers: int = SIDE_BY_SIDE) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="launch")
        self.futures: dict[str, Future] = {name: self._pool.submit(job) for name, job in jobs.items()}

    def result(self, name: str) -> Any:
        """The job's return value once it has finished (its exception re-raised here)."""
        return self.futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def module_jobs(request, jobs: dict[str, Callable[[], Any]]) -> SideBySide:
    """The jobs named by the ``launches`` markers of the requesting module's selected tests (in test order), started
    side by side: a module fixture's value (``close()`` it at teardown)."""
    names = [m.args[0] for item in request.session.items if item.module is request.module
             for m in item.iter_markers("launches")]  # fmt: skip
    return SideBySide({name: jobs[name] for name in dict.fromkeys(names)})


def run_side_by_side(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Every job's result, by name, after all have finished (the first failure, in ``jobs`` order, re-raised)."""
    runner = SideBySide(jobs)
    runner.close()
    return {name: runner.result(name) for name in jobs}
