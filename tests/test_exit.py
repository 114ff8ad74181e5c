"""A finished run exits 0 without ``trainer.end()`` (or ``sp.remove()``); a failing rank still fails the job promptly.

Each case is one ``torchrun`` launch of ``scripts/exit_check.py --worker KIND`` (2 processes, a tiny model, two
steps, the script simply ends). ``python scripts/exit_check.py --runs 30`` repeats them to count rare aborts.
"""

import importlib.util
import os

import pytest

pytestmark = pytest.mark.e2e  # launched jobs

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "exit_check.py")
_spec = importlib.util.spec_from_file_location("exit_check", _SCRIPT)
exit_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exit_check)


@pytest.mark.parametrize("kind", ["trainer", "sft", "dpo", "grpo", "free"])
def test_finished_run_exits_zero(kind):
    result = exit_check.launch(kind, exit_check.free_port(), timeout=300)
    assert result["rc"] == 0, result


def test_failing_rank_fails_the_job_promptly():
    result = exit_check.launch("raise", exit_check.free_port(), timeout=300)
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
