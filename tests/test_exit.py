"""A finished run exits 0 without ``trainer.end()`` (or ``sp.remove()``); a failing rank still fails the job promptly.

Each case is one ``torchrun`` launch of ``scripts/exit_check.py --worker KIND`` (2 processes, a tiny model, two
steps, the script simply ends), two at a time (``tests/launches.py``: a launch leaves a core idle while one process
imports). ``python scripts/exit_check.py --runs 30`` repeats them to count rare aborts.
"""

import importlib.util
import os

import pytest

from tests.launches import module_jobs
from tests.pool import free_port

pytestmark = pytest.mark.e2e  # launched jobs

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "exit_check.py")
_spec = importlib.util.spec_from_file_location("exit_check", _SCRIPT)
exit_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exit_check)


KINDS = ["trainer", "sft", "dpo", "grpo", "free"]


@pytest.fixture(scope="module")
def launches(request):
    """The launches of this module's selected tests, started at the first of them, two at a time."""
    runner = module_jobs(request, {kind: (lambda k=kind: exit_check.launch(k, free_port(), timeout=300))
                                   for kind in [*KINDS, "raise"]})  # fmt: skip
    yield runner
    runner.close()


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.launches(k)) for k in KINDS])
def test_finished_run_exits_zero(kind, launches):
    result = launches.result(kind)
    assert result["rc"] == 0, result


@pytest.mark.launches("raise")
def test_failing_rank_fails_the_job_promptly(launches):
    result = launches.result("raise")
    assert result["rc"] not in (0, "timeout") and result["error_shown"], result
    assert result["seconds"] < 240, result  # no exit barrier waited for the failed peer


def test_exit_finished_worker_runs_exit_hooks_then_exits_zero(tmp_path):
    """The launched CLI workers end with ``exit_finished_worker``: exit hooks and buffered output first, exit code 0."""
    import subprocess
    import sys

    marker = tmp_path / "hook_ran"
    code = (
        "import atexit, pathlib, sys\n"
        "from hf_sp_trainer.topology.teardown import exit_finished_worker\n"
        f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('yes'))\n"
        "sys.stdout.write('buffered, no newline')\n"
        "exit_finished_worker()\n"
        "raise SystemExit(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "buffered, no newline"
    assert marker.read_text() == "yes"


def _named_thread(name: str, busy: bool, stop):
    """A thread that names itself ``name`` for the kernel (``/proc/self/task/*/comm``, as gloo's workers do), then
    spins (``busy``) or sleeps on ``stop``."""
    import ctypes
    import threading

    def run():
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
        while busy and not stop.is_set():
            pass
        stop.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.unit
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux: threads read from /proc")
def test_settle_waits_for_busy_comm_threads_and_not_for_parked_ones():
    """The exit teardown's last wait (``settle_comm_threads``): parked gloo workers settle at once; one still running
    keeps it waiting until its timeout (it returns False), and it returns once that thread stops."""
    import threading
    import time

    from hf_sp_trainer.topology.teardown import COMM_THREAD_NAMES, settle_comm_threads

    stop_parked, stop_busy = threading.Event(), threading.Event()
    parked = _named_thread(COMM_THREAD_NAMES[0], busy=False, stop=stop_parked)
    try:
        time.sleep(0.1)
        start = time.monotonic()
        assert settle_comm_threads(timeout_s=5)
        assert time.monotonic() - start < 1
        busy = _named_thread(COMM_THREAD_NAMES[0], busy=True, stop=stop_busy)
        start = time.monotonic()
        assert not settle_comm_threads(timeout_s=0.5)  # a worker still running: no settling
        assert time.monotonic() - start >= 0.5
        threading.Timer(0.3, stop_busy.set).start()  # the busy one stops after 0.3 s
        assert settle_comm_threads(timeout_s=10)
        assert not settle_comm_threads(timeout_s=0)  # 0: the wait is off (HF_SP_EXIT_SETTLE_TIMEOUT_S=0)
    finally:
        stop_parked.set()
        stop_busy.set()
    parked.join(5)
    busy.join(5)
