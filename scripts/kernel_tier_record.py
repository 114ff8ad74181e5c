"""The GPU-kernel tier's recorded pass (``tests/interpreter/recorded_pass.json``), keyed on the source it ran.

The tier (``tests/interpreter``: FLA's, Liger's and mamba_ssm's Triton kernels on CPU through Triton's interpreter)
costs ~350 CPU seconds and its environment ~50 more: on CI's 2 cores that is what takes ``.ci/run`` past 30 minutes
(docs/testing.md). ``scripts/kernel_tier.sh --record`` runs it and, after a clean pass, writes this record: the
SHA-256 of every file the tier's result depends on (the package, ``setup.py``, the tier's files and pins, the script
that builds its environment and runs it, the test harness modules it imports), the versions it ran and the result.
``.ci/run`` runs the tier unless the record matches the checkout file for file -- a test-result cache keyed on its
inputs, as Bazel's: any change to those files, or a missing or malformed record, runs the tier in CI as before;
nothing is skipped on a source the tier did not pass.

Standard library only (``.ci/run`` calls it with the system ``python3``, before any environment exists)::

    python3 scripts/kernel_tier_record.py check     # exit 0: the record matches this checkout (and says so)
    python3 scripts/kernel_tier_record.py digests   # the input files' SHA-256 (kernel_tier.sh: before a run)
    python3 scripts/kernel_tier_record.py write --result R --before D   # after a clean pass (kernel_tier.sh)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = Path("tests/interpreter/recorded_pass.json")
# What the tier's outcome depends on in this repository (its library versions are pinned by constraints.txt, inside)
INPUTS = ("hf_sp_trainer", "setup.py", "pyproject.toml", "tests/interpreter", "scripts/kernel_tier.sh")
SKIP_PARTS = {"__pycache__", ".pytest_cache"}


def inputs(root: Path = ROOT) -> list[Path]:
    """Every file the record covers, relative to ``root``, sorted: ``INPUTS`` and the test package's modules that are
    not tests of the main suite (``tests/*.py`` other than ``test_*.py``: the harnesses, the pool, ``conftest.py``)."""
    found: set[Path] = set()
    for name in INPUTS:
        path = root / name
        if path.is_file():
            found.add(path)
        elif path.is_dir():
            found.update(p for p in path.rglob("*") if p.is_file() and not SKIP_PARTS & set(p.parts))
    found.update(p for p in (root / "tests").glob("*.py") if not p.name.startswith("test_"))
    found.discard(root / RECORD)
    return sorted(p.relative_to(root) for p in found if p.suffix not in (".pyc", ".pyo"))


def digests(root: Path = ROOT) -> dict[str, str]:
    """Each input file's SHA-256, by its path relative to ``root``."""
    return {str(p): hashlib.sha256((root / p).read_bytes()).hexdigest() for p in inputs(root)}


def differences(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """The files whose content differs between the record and the checkout (changed, added, removed)."""
    changed = [f"changed: {p}" for p in sorted(set(recorded) & set(current)) if recorded[p] != current[p]]
    added = [f"not in the record: {p}" for p in sorted(set(current) - set(recorded))]
    removed = [f"gone: {p}" for p in sorted(set(recorded) - set(current))]
    return changed + added + removed


def check(root: Path = ROOT) -> tuple[bool, str]:
    """Whether the record matches ``root``'s files, and a line saying why (or what it recorded)."""
    path = root / RECORD
    try:
        record = json.loads(path.read_text())
        recorded, result = record["files"], record["result"]
    except FileNotFoundError:
        return False, f"no recorded pass ({RECORD})"
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"{RECORD} is malformed ({exc!r})"
    if not isinstance(recorded, dict) or not isinstance(result, dict):
        return False, f"{RECORD} is malformed (files and result must be objects)"
    if not result.get("passed") or result.get("failed"):
        return False, f"{RECORD} records no clean pass: {result}"
    diff = differences(recorded, digests(root))
    if diff:
        shown = "; ".join(diff[:5]) + (f"; and {len(diff) - 5} more" if len(diff) > 5 else "")
        return False, f"the source changed since the recorded pass of {record.get('date')} ({shown})"
    return True, (
        f"passed on this source ({len(recorded)} files): {result['passed']} passed in {result['seconds']} s on "
        f"{record.get('date')}, {record.get('host')}; {record.get('versions')} (recorded by scripts/kernel_tier.sh "
        f"--record)"
    )


VERSIONED = ("torch", "triton", "flash-linear-attention", "liger-kernel", "mamba-ssm", "transformers")


def run_result(junit: Path, seconds: int) -> dict:
    """A run's result from its JUnit XML, with the versions installed in the running interpreter (``.venv-triton``)
    and the host's CPU."""
    suites = ET.parse(junit).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    return {
        "passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
        "failed": count["failures"] + count["errors"],
        "skipped": count["skipped"],
        "seconds": seconds,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": f"{os.cpu_count()} cores, {cpu}",
        "versions": ", ".join(f"{name} {metadata.version(name)}" for name in VERSIONED),
    }


def write(result_file: Path, before_file: Path, root: Path = ROOT) -> Path:
    """The record for ``root``'s files now, from the run's result (``run_result``); refused unless the run passed
    cleanly and the files are those it started on (``before_file``: ``digests`` taken before it)."""
    run = json.loads(result_file.read_text())
    if not run.get("passed") or run.get("failed"):
        raise SystemExit(f"not a clean pass, nothing recorded: {run}")
    files = digests(root)
    moved = differences(json.loads(before_file.read_text()), files)
    if moved:
        raise SystemExit(f"files changed during the run, nothing recorded: {moved[:5]}")
    record = {
        "about": "scripts/kernel_tier_record.py: the GPU-kernel tier passed on exactly these files",
        "date": run["date"],
        "host": run["host"],
        "versions": run["versions"],
        "result": {k: run[k] for k in ("passed", "failed", "skipped", "seconds")},
        "files": files,
    }
    (root / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return root / RECORD


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="exit 0 when the record matches this checkout")
    sub.add_parser("digests", help="print the input files' digests (JSON)")
    r = sub.add_parser("result", help="a run's result JSON from its JUnit XML (run with the tier's python)")
    r.add_argument("--junit", type=Path, required=True)
    r.add_argument("--seconds", type=int, required=True)
    w = sub.add_parser("write", help="record a passing run")
    w.add_argument("--result", type=Path, required=True, help="the run's result JSON (the result command's)")
    w.add_argument("--before", type=Path, required=True, help="the digests taken before the run")
    args = parser.parse_args(argv)
    if args.command == "digests":
        print(json.dumps(digests(), indent=1))
    elif args.command == "result":
        print(json.dumps(run_result(args.junit, args.seconds)))
    elif args.command == "write":
        print(f"recorded: {write(args.result, args.before).relative_to(ROOT)}")
    else:
        ok, why = check()
        print(f"GPU-kernel tier: {why}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
