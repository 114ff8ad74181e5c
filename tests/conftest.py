"""The suite's tiers, their guard, their recorded durations and budgets, and the session's gloo pool.

Tiers (``pyproject.toml``'s markers): every test has exactly one of ``unit`` (in-process), ``dist`` (the gloo
worlds of ``tests/pool.py``), ``matrix`` (the big parametrised sweeps over those worlds) and ``e2e`` (launched jobs),
its own or its module's (``pytestmark``; a test's own marker overrides its module's). ``slow`` is added to every
test that is not ``unit`` (``-m "not slow"`` == ``-m unit``).

- A test without a tier, or with two of its own, fails the collection (a usage error naming it).
- A ``unit`` test that starts a process (``multiprocessing``, ``subprocess``, the gloo pool) in the main thread
  fails, naming the tier to use, in setup, call or teardown, even where the test catches the exception (the jobs
  e2e tests start in background threads, ``tests/launches.py``, may still be running).
- At the session's end the gloo pool is shut down; a tier that ran in full (the whole ``tests`` directory, no
  ``-k``, nothing of it deselected, not stopped early) has its wall time (its tests' setup + call + teardown) recorded,
  and the session's too when every tier ran; one over its budget in ``tier_budgets.json`` (scaled by this host's
  speed, ``host_scale``) fails the session (``HF_SP_TEST_BUDGETS=0``: recorded, not enforced). A run writes no
  tracked file: the record goes to the ignored ``.pytest_cache/hf_sp/tier_durations.json``; ``--record-durations``
  writes the committed ``tier_durations.json``.
"""

from __future__ import annotations

import gc
import json
import multiprocessing.process
import os
import resource
import subprocess
import sys
import threading
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed on CPU JIT-builds its shared-memory op (deepspeed_shm_comm) at every engine start into torch's extension
# directory, by default one per Python version shared by every environment: the main suite's and the oldest-stack
# tier's environments (other include paths) overwrote each other's build, and each rebuilt it (2 x 35 CPU s, 113 s
# inside the main suite in one CI run). One directory per environment, its build kept for the whole run.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch-extensions"))

from tests.upstream import CACHE_ARGUMENT  # noqa: E402 (the repository on sys.path first)

try:  # py-cpuinfo (vLLM's and DeepSpeed's) runs `file -b` when first imported: here, not inside a unit test
    import cpuinfo  # noqa: E402, F401
except ImportError:
    pass

# The SP versions of modules that take `cache` (DSA, QSA, block-sparse top-k, Qwen4-Exp's token history) need
# transformers >= 5.24; before it their families are refused under SP, which
# test_mixers_detect.test_cache_argument_families_refused_before_5_24 checks: their own tests don't apply there.
CACHE_ARGUMENT_TESTS = ["test_dsa.py", "test_qsa.py", "test_token_history.py", "test_block_sparse.py"]
collect_ignore = [] if CACHE_ARGUMENT else CACHE_ARGUMENT_TESTS

TIERS = ("unit", "dist", "matrix", "e2e")
BUDGETS = os.path.join(TESTS, "tier_budgets.json")
DURATIONS = os.path.join(TESTS, "tier_durations.json")  # the committed record (--record-durations)
RUN_DURATIONS = os.path.join(os.path.dirname(TESTS), ".pytest_cache", "hf_sp", "tier_durations.json")  # ignored


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write the tiers' wall times into the committed tests/tier_durations.json (default: an ignored file)",
    )


USE = {
    "dist": "spawned gloo worlds (run_distributed)",
    "matrix": "a big parametrised sweep over gloo worlds",
    "e2e": "launched jobs: CLIs, launchers, scripts, subprocesses",
}


# ----------------------------------------------------------------------------------------------------------------
# tiers
# ----------------------------------------------------------------------------------------------------------------
def tier_of(item: pytest.Item) -> str | None:
    """The item's closest tier marker (its own, else its class's, else its module's); None if it has none."""
    by_node: dict[int, set[str]] = {}
    order: list[int] = []
    for node, mark in item.iter_markers_with_node():
        if mark.name in TIERS:
            if id(node) not in by_node:
                by_node[id(node)] = set()
                order.append(id(node))
            by_node[id(node)].add(mark.name)
    if not order:
        return None
    closest = by_node[order[0]]
    if len(closest) > 1:
        raise ValueError(f"{item.nodeid}: tier markers {sorted(closest)} on one node; give it exactly one")
    return next(iter(closest))


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the `slow` alias must be there to select on
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    errors = []
    for item in items:
        try:
            tier = tier_of(item)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        if tier is None:
            errors.append(f"{item.nodeid}: no tier marker; mark it (or its module's pytestmark) with one of {TIERS}")
            continue
        item.stash[TIER] = tier
        item.add_marker(getattr(pytest.mark, tier))
        if tier != "unit":
            item.add_marker(pytest.mark.slow)
        _state["selected"][tier] = _state["selected"].get(tier, 0) + 1
    if errors:
        raise pytest.UsageError("tests without exactly one tier marker:\n  " + "\n  ".join(errors))
    for node in {id(n): n for item in items for n in item.listchain()[:-1]}.values():
        # -m matches every marker up the chain: a module's tier stays only on the tests that have no tier of their own
        node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.stash.get(TIER, None)
        _state["deselected"].add(tier)


TIER = pytest.StashKey[str]()
_state: dict = {"selected": {}, "deselected": set(), "seconds": {}, "failed": {}, "item": None, "violations": {}}


# ----------------------------------------------------------------------------------------------------------------
# the guard: unit tests start no process
# ----------------------------------------------------------------------------------------------------------------
class StartedAProcess(RuntimeError):
    pass


def _guard(what: str) -> None:
    item = _state["item"]
    if item is None or threading.current_thread() is not threading.main_thread():
        return  # (a launch in a background thread belongs to an e2e test's jobs: tests/launches.py)
    message = (
        f"{item.nodeid} is marked `unit` (in-process) but started a process ({what}). Mark it `dist` "
        f"({USE['dist']}), `matrix` ({USE['matrix']}) or `e2e` ({USE['e2e']})."
    )
    _state["violations"].setdefault(item.nodeid, message)
    raise StartedAProcess(message)


def _guarded(original, what):
    def start(self, *args, **kwargs):
        _guard(what(self, *args, **kwargs))
        return original(self, *args, **kwargs)

    start.__wrapped__ = original
    return start


multiprocessing.process.BaseProcess.start = _guarded(
    multiprocessing.process.BaseProcess.start, lambda p: f"multiprocessing {type(p).__name__}.start"
)
subprocess.Popen.__init__ = _guarded(
    subprocess.Popen.__init__, lambda p, *a, **k: f"subprocess {str(a[0] if a else k.get('args'))[:200]}"
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _state["item"] = item if item.stash.get(TIER, None) == "unit" else None
    try:
        yield
    finally:
        _state["item"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """The phase (setup, call or teardown) in which a `unit` test started a process fails, with the guard's message
    first, even where the test caught the exception."""
    outcome = yield
    report = outcome.get_result()
    message = _state["violations"].pop(item.nodeid, None)
    if message is not None:
        report.longrepr = message if report.passed else f"{message}\n\n{report.longrepr}"
        report.outcome = "failed"


# ----------------------------------------------------------------------------------------------------------------
# durations and budgets
# ----------------------------------------------------------------------------------------------------------------
def pytest_sessionstart(session: pytest.Session) -> None:
    from tests import pool

    _state["start"] = time.monotonic()
    _state["cpu_start"] = _cpu_seconds()
    pool.guard = _guard


def _cpu_seconds() -> float:
    """User + system time of this process and of its children that have exited (pool ranks, launched jobs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = _state["tiers_by_id"].get(report.nodeid) if "tiers_by_id" in _state else None
    if tier is None:
        return
    _state["seconds"][tier] = _state["seconds"].get(tier, 0.0) + report.duration
    if report.failed:
        _state["failed"].setdefault(tier, set()).add(report.nodeid)


def pytest_collection_finish(session: pytest.Session) -> None:
    _state["tiers_by_id"] = {item.nodeid: item.stash.get(TIER, None) for item in session.items}
    from tests import harness

    harness.SELECTED_CASES = selected_cases(session)
    gc.collect()
    gc.freeze()  # the imported test modules and libraries: out of the collections in-process Trainer runs start


# The modules whose worlds run a list of cases for tests parametrized by them (``harness.only_selected``)
CASE_MODULES = ("test_equivalence", "test_sft", "test_dpo", "test_kto", "test_reward", "test_grpo")


def selected_cases(session: pytest.Session) -> set[str] | None:
    """The names of the cases the selected tests are parametrized by, when the session was narrowed; None (every case)
    for the whole directory or when a selected test of a case module has no case parameter."""
    if _whole_directory(session.config):
        return None
    items = session.items
    return case_names((getattr(i, "module", None), getattr(getattr(i, "callspec", None), "params", {})) for i in items)


def case_names(items) -> set[str] | None:
    """``selected_cases`` for ``(module, parameters)`` pairs: the cases' names (a parameter with a ``name`` and a
    ``world_size``), or None where a test of a ``CASE_MODULES`` module has none."""
    names: set[str] = set()
    for module, params in items:
        cases = [v for v in params.values() if hasattr(v, "name") and hasattr(v, "world_size")]
        if cases:
            names.update(c.name for c in cases)
        elif module is not None and module.__name__.rsplit(".", 1)[-1] in CASE_MODULES:
            return None
    return names


def _whole_directory(config: pytest.Config) -> bool:
    """Whether the session collected the whole tests directory: no path below it, no node id, no -k."""
    if config.option.keyword or getattr(config.option, "deselect", None) or getattr(config.option, "lf", False):
        return False
    args = config.args or [TESTS]
    return all(os.path.realpath(os.path.join(config.invocation_params.dir, a)) == TESTS for a in args)


def complete_tiers(session: pytest.Session) -> list[str]:
    """The tiers this session ran in full."""
    if session.config.option.collectonly or not _whole_directory(session.config):
        return []
    if session.shouldstop or session.shouldfail:  # -x, --maxfail, an interrupt
        return []
    if session.exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return []
    ran = {i.stash.get(TIER, None) for i in session.items}
    return [t for t in TIERS if t in ran and t not in _state["deselected"]]


def host_scale(reference_cpu_seconds: float) -> float:
    """This host's slowness against the one the budgets were set for: the CPU time of a fixed workload (a tiny Llama's
    forward and backward, 100 times, one thread: Python overhead and small kernels, as the suite) over the reference
    host's, at least 1 / 2 and at most 4. Times are host-dependent: a budget must mean the same on every host."""
    import torch

    from tests.harness import tiny_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model("llama")
        ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()  # warm
        start = time.process_time()
        for _ in range(100):
            model(input_ids=ids, labels=ids).loss.backward()
        return min(4.0, max(0.5, (time.process_time() - start) / reference_cpu_seconds))
    finally:
        torch.set_num_threads(threads)


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    from tests import pool

    pool.shutdown()
    if "start" not in _state:
        return
    wall = time.monotonic() - _state["start"]
    cpu = _cpu_seconds() - _state["cpu_start"]
    tiers = complete_tiers(session)
    if not tiers:
        return
    with open(BUDGETS) as f:
        budgets = json.load(f)
    path = DURATIONS if session.config.getoption("record_durations") else RUN_DURATIONS
    os.makedirs(os.path.dirname(path), exist_ok=True)
    recorded = json.load(open(path)) if os.path.exists(path) else {}
    now = time.strftime("%Y-%m-%d")
    for tier in tiers:
        recorded[tier] = {"seconds": round(_state["seconds"].get(tier, 0.0), 1), "tests": _state["selected"][tier],
                          "failed": len(_state["failed"].get(tier, ())), "date": now}  # fmt: skip
    selection = "all" if set(tiers) == set(TIERS) else tiers[0] if len(tiers) == 1 else None
    if selection is not None:  # the wall time of `pytest tests` / `pytest tests -m <tier>`, collection included
        recorded.setdefault("sessions", {})[selection] = {
            "seconds": round(wall, 1),
            "cpu_seconds": round(cpu),
            "date": now,
        }
    recorded["machine"] = f"{os.cpu_count()} cores"
    with open(path, "w") as f:
        json.dump(recorded, f, indent=2, sort_keys=True)
        f.write("\n")
    over = []
    scale = host_scale(budgets["calibration_cpu_seconds"])
    for tier in tiers:
        if recorded[tier]["seconds"] > budgets[tier] * scale:
            over.append(f"tier {tier}: {recorded[tier]['seconds']:.0f} s, budget {budgets[tier] * scale:.0f} s")
    if selection is not None and wall > budgets["sessions"][selection] * scale:
        over.append(f"session ({selection}): {wall:.0f} s, budget {budgets['sessions'][selection] * scale:.0f} s")
    if over:
        load = os.getloadavg()
        _state["over"] = over + [
            f"(budgets of {os.path.relpath(BUDGETS)} x {scale:.2f}, this host's speed: `host_scale`)",
            f"(the session's processes used {cpu:.0f} s of CPU in {wall:.0f} s on {os.cpu_count()} cores; load average "
            f"{load[0]:.1f} now, {load[2]:.1f} over 15 min: a load above the core count means other work slowed this "
            f"run; budgets: {os.path.relpath(BUDGETS)}, HF_SP_TEST_BUDGETS=0 records without enforcing)",
        ]
        if os.environ.get("HF_SP_TEST_BUDGETS", "1") != "0" and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _state.get("over"):
        terminalreporter.section("over the time budget", sep="=", red=True, bold=True)
        for line in _state["over"]:
            terminalreporter.write_line(line, red=True)
