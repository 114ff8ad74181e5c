"""Preemption loses nothing, and a save killed midway never leaves a checkpoint that looks complete
(``hf_sp_trainer/trainers/preemption.py``).

Real ``torchrun --nproc_per_node 2`` launches of ``tests/preemption_job.py`` (a tiny SPTrainer run: sp_size 2, gloo,
CPU, 12 steps, a checkpoint every 4), real signals, in two lanes side by side (``tests/launches.py``):

- lane A: SIGTERM to rank 1 only during a step (rank 0 never gets it): both stop after the step, save it, exit 75;
  then three relaunches, each SIGKILLing rank 0 at one point of its first save (before the model file; after the model,
  before the optimizer; after everything, before the completion marker), each of which must resume from the
  preemption checkpoint; a last relaunch trains to the end;
- lane B: the uninterrupted reference; SIGTERM to the torchrun agent and every worker (what Slurm does at preemption);
  a relaunch whose rank 1 is SIGKILLed in the next save (rank 0 then writes everything but rank 1's RNG state: what
  Trainer's own ``get_last_checkpoint`` takes as the last checkpoint); a relaunch to the end; the negative control
  (a checkpoint whose weights are one save behind its step).

Each finished chain must equal the reference exactly (DDP on CPU: per-step loss and grad norm, and every parameter,
bit for bit), every step logged once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.launches import port_flags, run_side_by_side

pytestmark = pytest.mark.e2e  # launched jobs; the tests marked otherwise below are not

JOB = Path(__file__).with_name("preemption_job.py")
ROOT = JOB.parents[1]
MAX_STEPS, SAVE_STEPS = 12, 4  # preemption_job's
EXIT_REQUEUE = 75
MARKER = "checkpoint_complete.json"
LAUNCH_TIMEOUT_S = 300
# What torchrun's agent prints when SIGTERM stops it: its own line, or (seen with torch 2.13) the traceback of a race in
# torch.distributed.elastic.metrics.api.prof: a signal raised between its ``try:`` and ``start = time.time()`` turns
# into this UnboundLocalError in its ``finally``, which hides the SignalException; the agent still shuts its workers
# down (``SimpleElasticAgent.run``'s own ``finally``). Seen once in CI (stop 62, an Intel host).
AGENT_STOPPED_ON_SIGNAL = (
    "death signal, shutting down workers",
    "UnboundLocalError: cannot access local variable 'start' where it is not associated with a value",
)


# -- launching ------------------------------------------------------------------------------------------------------
def _workers(agent: int) -> dict[int, int]:
    """The torchrun agent's worker processes, by rank (from /proc)."""
    found = {}
    for task in Path(f"/proc/{agent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(pid)
    return found


def _steps(out: Path, launch: str) -> list[dict]:
    path = out / "steps.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r["launch"] == launch]


def launch(out: Path, name: str, resume: str | None = None, env: dict | None = None, signal_after: int | None = None,
           signal_to: str = "rank1") -> dict:  # fmt: skip
    """One torchrun launch of the job. ``signal_after``: once a step after that one is logged, SIGTERM goes to
    ``signal_to``: ``rank1`` (that worker only) or ``all`` (the agent and every worker). Returns the exit code, the
    output, the steps it trained and the checkpoints on disk afterwards (each with its files)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *port_flags("torchrun"), str(JOB),
           str(out)] + (["--resume", resume] if resume else [])  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT),
                "PREEMPTION_TEST_LAUNCH": name, **(env or {})}  # fmt: skip
    log_path = out.parent / f"{out.name}-{name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
        try:
            if signal_after is not None:
                while not any(r["step"] > signal_after for r in _steps(out, name)):
                    assert proc.poll() is None, f"{name} ended before step {signal_after + 1}"
                    time.sleep(0.05)
                workers = _workers(proc.pid)
                targets = [workers[1]] if signal_to == "rank1" else [proc.pid, *workers.values()]
                for pid in targets:
                    os.kill(pid, signal.SIGTERM)
            rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    output = log_path.read_text()
    worker_codes = {int(r): int(c) for r, c in re.findall(r"rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", output)}
    disk = {p.name: sorted(os.listdir(p)) for p in sorted(out.glob("checkpoint-*"))}
    return {"rc": rc, "output": output, "worker_codes": worker_codes, "steps": _steps(out, name), "disk": disk,
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def _next_save(step: int) -> str:
    return f"checkpoint-{(step // SAVE_STEPS + 1) * SAVE_STEPS}"


def lane_a(out: Path) -> dict:
    runs = {"sigterm_rank1": launch(out, "sigterm_rank1", env={"PREEMPTION_TEST_STEP_SLEEP": "0.4"}, signal_after=4)}
    for point in ("save_model:before", "save_model:after", "marker:before"):
        runs[point] = launch(out, point, resume="true", env={"PREEMPTION_TEST_KILL": f"{point}:0"})
    runs["to_end"] = launch(out, "to_end", resume="true")
    return runs


def lane_b(ref: Path, out: Path, negative: Path) -> dict:
    runs = {"reference": launch(ref, "reference")}
    runs["sigterm_all"] = launch(
        out, "sigterm_all", env={"PREEMPTION_TEST_STEP_SLEEP": "0.4"}, signal_after=2, signal_to="all"
    )
    runs["rank1:save_model:after"] = launch(
        out, "rank1:save_model:after", resume="true", env={"PREEMPTION_TEST_KILL": "save_model:after:1"}
    )
    runs["to_end"] = launch(out, "to_end", resume="true")
    # negative control: checkpoint-8 made of checkpoint-4's weights, optimizer and RNG under checkpoint-8's state
    stale = negative / "checkpoint-8"
    shutil.copytree(ref / "checkpoint-4", stale)
    shutil.copy(ref / "checkpoint-8" / "trainer_state.json", stale / "trainer_state.json")
    runs["negative"] = launch(negative, "negative", resume="true")
    return runs


@pytest.fixture(scope="module")
def lanes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preemption")
    dirs = {name: tmp / name for name in ("a", "b", "reference", "negative")}
    for d in dirs.values():
        d.mkdir()
    start = time.perf_counter()
    result = run_side_by_side({"a": lambda: lane_a(dirs["a"]),
                               "b": lambda: lane_b(dirs["reference"], dirs["b"], dirs["negative"])})  # fmt: skip
    print(f"preemption lanes: {time.perf_counter() - start:.0f} s;",
          {f"{lane}/{k}": r["seconds"] for lane, runs in result.items() for k, r in runs.items()})  # fmt: skip
    return SimpleNamespace(**result, dirs=dirs)


# -- comparing ------------------------------------------------------------------------------------------------------
def per_step(log_history: list[dict]) -> list[tuple[int, float, float]]:
    return [(e["step"], e["loss"], e["grad_norm"]) for e in log_history if "loss" in e and "grad_norm" in e]


def differences(reference: Path, run: Path) -> list[str]:
    """What differs between a finished run and the uninterrupted reference: steps not logged exactly once, any step's
    loss or grad norm, any parameter (all exact: DDP on CPU is bit-exact)."""
    import torch

    found = []
    ref_steps = per_step(json.loads((reference / "final.json").read_text())["log_history"])
    steps = per_step(json.loads((run / "final.json").read_text())["log_history"])
    if [s for s, *_ in steps] != list(range(1, MAX_STEPS + 1)):
        found.append(f"steps logged: {[s for s, *_ in steps]}")
    found += [f"step {a[0]}: {a[1:]} != {b[1:]}" for a, b in zip(steps, ref_steps, strict=False) if a != b]
    ref_params, params = (torch.load(d / "final.pt") for d in (reference, run))
    found += [f"parameter {k} differs" for k in ref_params if not torch.equal(ref_params[k], params[k])]
    return found


def _output_of(run: dict) -> str:
    return run["output"][-4000:]


# -- tests ----------------------------------------------------------------------------------------------------------
def test_sigterm_to_one_rank_stops_every_rank_after_the_step(lanes):
    """Only rank 1 gets SIGTERM: the ranks agree at the step's end, save that step, and both exit 75 (torchrun, which
    reduces any failure to 1, names each worker's code)."""
    run = lanes.a["sigterm_rank1"]
    steps = [r["step"] for r in run["steps"]]
    assert run["worker_codes"] == {0: EXIT_REQUEUE, 1: EXIT_REQUEUE} and run["rc"] == 1, _output_of(run)
    stopped = steps[-1]
    assert steps == list(range(1, stopped + 1)) and stopped < MAX_STEPS, steps
    marker = json.loads((lanes.dirs["a"] / f"checkpoint-{stopped}" / MARKER).read_text())
    assert marker["global_step"] == stopped and marker["preempted"] is True, marker
    assert "Preempted (a peer's signal)" in run["output"]  # rank 0 logs it: it stopped on rank 1's signal


def test_sigterm_to_agent_and_workers_saves_then_exits(lanes):
    """Slurm signals every process of the step: torchrun forwards SIGTERM to the workers (which got it already) and
    waits; they finish the step, save it and exit with 75 before torchrun's shutdown timeout."""
    run = lanes.b["sigterm_all"]
    steps = [r["step"] for r in run["steps"]]
    stopped = steps[-1]
    assert run["rc"] != 0 and any(line in run["output"] for line in AGENT_STOPPED_ON_SIGNAL), _output_of(run)
    assert f"Preempted (SIGTERM): stopped after step {stopped}" in run["output"], _output_of(run)
    assert f"exiting with {EXIT_REQUEUE}" in run["output"] and "forcefully exiting via" not in run["output"]
    assert steps == list(range(1, stopped + 1)) and stopped < MAX_STEPS, steps
    assert json.loads((lanes.dirs["b"] / f"checkpoint-{stopped}" / MARKER).read_text())["preempted"] is True


KILLS = {  # kill point -> (lane, files that must be missing from the checkpoint it interrupted)
    "save_model:before": ("a", {"model.safetensors", "optimizer.pt", MARKER}),
    "save_model:after": ("a", {"optimizer.pt", MARKER}),
    "marker:before": ("a", {MARKER}),
    "rank1:save_model:after": ("b", {"rng_state_1.pth", MARKER}),
}


@pytest.mark.parametrize("point", list(KILLS))
def test_a_killed_save_is_never_resumed_from(point, lanes):
    """A rank SIGKILLed inside a save: the job fails, the interrupted checkpoint has no marker, and the next launch
    (``resume_from_checkpoint=True``) resumes from the preemption checkpoint, the newest complete one."""
    lane, missing = KILLS[point]
    runs = getattr(lanes, lane)
    preempted = runs["sigterm_rank1" if lane == "a" else "sigterm_all"]["steps"][-1]["step"]
    run, interrupted = runs[point], _next_save(preempted)
    print(point, "left on disk:", run["disk"].get(interrupted, "(no directory)"))
    assert run["rc"] != 0 and "SIGKILLs itself" in run["output"], _output_of(run)
    assert run["steps"][0]["step"] == preempted + 1, run["steps"]  # resumed from the preemption checkpoint
    assert run["steps"][-1]["step"] == int(interrupted.split("-")[1]), run["steps"]
    assert not missing & set(run["disk"].get(interrupted, [])), run["disk"]
    after = list(runs)[list(runs).index(point) + 1]
    assert runs[after]["steps"][0]["step"] == preempted + 1, runs[after]["steps"]  # the incomplete one skipped
    if point in ("marker:before", "rank1:save_model:after"):  # complete-looking by Trainer's own standard
        assert {"trainer_state.json", "optimizer.pt", "model.safetensors"} <= set(run["disk"][interrupted])
        assert "Skipping incomplete checkpoint(s) ['" + interrupted in runs[after]["output"]


@pytest.mark.parametrize("lane", ["a", "b"])
def test_interrupted_chain_equals_the_uninterrupted_run(lane, lanes):
    """Stopped by SIGTERM, killed inside saves, resumed each time: the same per-step losses and grad norms, and the
    same final weights, bit for bit; each step logged once; each launch continued where the last complete checkpoint
    left off (nothing trained twice after a preemption)."""
    runs = getattr(lanes, lane)
    assert runs["to_end"]["rc"] == 0, _output_of(runs["to_end"])
    assert differences(lanes.dirs["reference"], lanes.dirs[lane]) == []
    first = runs["sigterm_rank1" if lane == "a" else "sigterm_all"]["steps"]
    assert runs["to_end"]["steps"][0]["step"] == first[-1]["step"] + 1
    assert [r["step"] for r in runs["to_end"]["steps"]][-1] == MAX_STEPS


def test_negative_control_a_stale_checkpoint_is_caught(lanes):
    """Resuming from weights one save behind the checkpoint's step trains the remaining steps differently: the
    comparison above sees it."""
    assert lanes.b["negative"]["rc"] == 0, _output_of(lanes.b["negative"])
    found = differences(lanes.dirs["reference"], lanes.dirs["negative"])
    assert any(f.startswith("step 9:") for f in found) and any(f.startswith("parameter") for f in found), found


# -- in process: resolution, rotation, signal handling ----------------------------------------------------------------
def _checkpoint(folder: Path, step: int, complete: bool) -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir()
    (path / "trainer_state.json").write_text("{}")
    if complete:
        (path / MARKER).write_text("{}")
    return path


def _trainer(folder: Path) -> SimpleNamespace:
    return SimpleNamespace(args=SimpleNamespace(output_dir=str(folder)), is_world_process_zero=lambda: True)


@pytest.mark.unit
def test_resume_true_takes_the_newest_complete_checkpoint(tmp_path, caplog):
    from hf_sp_trainer.trainers import preemption

    trainer = _trainer(tmp_path)
    assert preemption.resolve_resume(trainer, True) is True  # nothing at all: Trainer's own error
    _checkpoint(tmp_path, 9, complete=False)
    with pytest.raises(ValueError, match="No complete checkpoint"):
        preemption.resolve_resume(trainer, True)
    _checkpoint(tmp_path, 4, complete=True)
    _checkpoint(tmp_path, 8, complete=True)
    _checkpoint(tmp_path, 12, complete=False)
    assert preemption.resolve_resume(trainer, True) == str(tmp_path / "checkpoint-8")
    assert preemption.resolve_resume(trainer, str(tmp_path / "checkpoint-4")) == str(tmp_path / "checkpoint-4")
    assert preemption.resolve_resume(trainer, None) is None
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-12", "checkpoint-4", "checkpoint-8", "checkpoint-9"]


@pytest.mark.unit
def test_rotation_keeps_the_newest_complete_checkpoint(tmp_path):
    """save_total_limit=1 with a stale incomplete checkpoint numbered above the one just saved (their mtimes within a
    second: Trainer's rotation then orders by number and would keep the incomplete one only)."""
    from transformers.trainer_utils import rotate_checkpoints

    from hf_sp_trainer.trainers import preemption

    for folder in (tmp_path / "ours", tmp_path / "trainer"):
        folder.mkdir()
        _checkpoint(folder, 4, complete=True)
        _checkpoint(folder, 12, complete=False)
        _checkpoint(folder, 8, complete=True)
    preemption.rotate(str(tmp_path / "ours"), 1, None, str(tmp_path / "ours" / "checkpoint-8"))
    assert sorted(os.listdir(tmp_path / "ours")) == ["checkpoint-12", "checkpoint-8"]
    rotate_checkpoints(str(tmp_path / "trainer"), save_total_limit=1, use_mtime=True)  # what it replaces
    assert sorted(os.listdir(tmp_path / "trainer")) == ["checkpoint-12"]


@pytest.mark.unit
def test_signal_only_sets_a_flag_and_handlers_are_restored():
    from hf_sp_trainer.trainers.preemption import PreemptionCallback

    callback = PreemptionCallback(signals=("SIGUSR1", "TERM"), exit_code=None)
    before = signal.getsignal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    callback.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, twice: still alive, one flag
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert callback.received == signal.SIGUSR1
        assert callback._agree(SimpleNamespace(device="cpu"))  # no process group: the local flag
    finally:
        callback.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and signal.getsignal(signal.SIGTERM) == before


@pytest.mark.unit
def test_settings_from_the_environment(monkeypatch):
    from hf_sp_trainer.trainers import preemption

    monkeypatch.delenv("HF_SP_PREEMPTION_SIGNALS", raising=False)
    monkeypatch.delenv("HF_SP_PREEMPTION_EXIT_CODE", raising=False)
    assert preemption.signals_from_env() == (signal.SIGTERM, signal.SIGUSR1)
    assert preemption.exit_code_from_env() == EXIT_REQUEUE == preemption.EXIT_REQUEUE
    monkeypatch.setenv("HF_SP_PREEMPTION_SIGNALS", "USR2, 15")
    monkeypatch.setenv("HF_SP_PREEMPTION_EXIT_CODE", "none")
    assert preemption.signals_from_env() == (signal.SIGUSR2, signal.SIGTERM)
    assert preemption.exit_code_from_env() is None
    monkeypatch.setenv("HF_SP_PREEMPTION_SIGNALS", "")
    assert preemption.signals_from_env() == ()
