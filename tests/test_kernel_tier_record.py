"""The GPU-kernel tier's recorded pass (``scripts/kernel_tier_record.py``): ``.ci/run`` skips the tier only when the
record matches every file it covers, so the record must cover what the tier's outcome depends on and name what changed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kernel_tier_record", ROOT / "scripts" / "kernel_tier_record.py")
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)

RUN = {"passed": 62, "failed": 0, "skipped": 0, "seconds": 172, "date": "d", "host": "h", "versions": "v"}


def test_inputs_cover_the_package_the_tier_and_the_harnesses_not_the_main_suites_tests():
    files = {str(p) for p in record.inputs()}
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "hf_sp_trainer").rglob("*.py")}
    assert package <= files
    tier = {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "interpreter").iterdir() if p.is_file()}
    assert tier - {str(record.RECORD)} <= files and "tests/interpreter/constraints.txt" in files
    harnesses = {"tests/harness.py", "tests/family_harness.py", "tests/mixer_harness.py", "tests/pool.py"}
    assert harnesses | {"tests/conftest.py", "setup.py", "scripts/kernel_tier.sh"} <= files
    assert not {f for f in files if Path(f).name.startswith("test_") and Path(f).parent == Path("tests")}
    assert str(record.RECORD) not in files and not any("__pycache__" in f for f in files)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small copy of the covered layout, with a recorded pass of it."""
    covered = ("hf_sp_trainer/__init__.py", "hf_sp_trainer/mixers/gdn.py", "tests/harness.py", "setup.py",
               "tests/interpreter/constraints.txt", "scripts/kernel_tier.sh")  # fmt: skip
    for rel in (*covered, "tests/test_equivalence.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    (tmp_path / "result.json").write_text(json.dumps(RUN))
    (tmp_path / "before.json").write_text(json.dumps(record.digests(tmp_path)))
    record.write(tmp_path / "result.json", tmp_path / "before.json", tmp_path)
    return tmp_path


def test_a_matching_record_is_accepted_and_says_what_it_recorded(tree: Path):
    ok, why = record.check(tree)
    assert ok, why
    assert "62 passed in 172 s" in why and "6 files" in why


@pytest.mark.parametrize("change", ["edit", "add", "remove"])
def test_any_change_to_a_covered_file_runs_the_tier_and_is_named(tree: Path, change: str):
    """The negative control: one byte in one covered file, a new file, a removed one."""
    if change == "edit":
        (tree / "hf_sp_trainer/mixers/gdn.py").write_text("# hf_sp_trainer/mixers/gdn.py!\n")
        named = "changed: hf_sp_trainer/mixers/gdn.py"
    elif change == "add":
        (tree / "tests/interpreter/workers.py").write_text("x = 1\n")
        named = "not in the record: tests/interpreter/workers.py"
    else:
        (tree / "tests/harness.py").unlink()
        named = "gone: tests/harness.py"
    ok, why = record.check(tree)
    assert not ok and named in why, why


def test_files_outside_the_inputs_do_not_matter(tree: Path):
    (tree / "tests/test_equivalence.py").write_text("changed\n")
    (tree / "hf_sp_trainer/__pycache__").mkdir()
    (tree / "hf_sp_trainer/__pycache__/x.pyc").write_bytes(b"\0")
    assert record.check(tree)[0]


def test_no_record_a_malformed_one_or_a_failed_run_is_never_a_pass(tree: Path):
    path = tree / record.RECORD
    saved = path.read_text()
    path.write_text("{not json")
    assert not record.check(tree)[0]
    path.write_text(json.dumps({**json.loads(saved), "result": [RUN]}))
    assert record.check(tree) == (False, f"{record.RECORD} is malformed (files and result must be objects)")
    path.write_text(json.dumps({**json.loads(saved), "result": {**RUN, "failed": 1}}))
    assert not record.check(tree)[0]
    path.unlink()
    assert record.check(tree) == (False, f"no recorded pass ({record.RECORD})")
    (tree / "result.json").write_text(json.dumps({**RUN, "failed": 2}))
    with pytest.raises(SystemExit, match="not a clean pass"):
        record.write(tree / "result.json", tree / "before.json", tree)
    assert not path.exists()


def test_files_changed_during_the_run_are_not_recorded(tree: Path):
    (tree / record.RECORD).unlink()
    (tree / "setup.py").write_text("# edited while the tier ran\n")
    with pytest.raises(SystemExit, match="changed during the run"):
        record.write(tree / "result.json", tree / "before.json", tree)


def test_the_committed_record_if_any_is_a_clean_pass_of_the_tier():
    """Well-formed and a pass (whether it matches this checkout is ``.ci/run``'s question, not this test's)."""
    path = ROOT / record.RECORD
    if not path.exists():
        pytest.skip(f"no {record.RECORD}: .ci/run runs the tier")
    committed = json.loads(path.read_text())
    assert committed["result"]["passed"] > 0 and committed["result"]["failed"] == 0, committed["result"]
    assert set(committed["files"]) and all(len(h) == 64 for h in committed["files"].values())
    assert "flash-linear-attention" in committed["versions"] and "triton" in committed["versions"]


def test_ci_runs_the_tier_unless_the_record_matches():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "if ! python3 scripts/kernel_tier_record.py check; then" in ci
    assert "scripts/kernel_tier.sh --install-log" in ci
