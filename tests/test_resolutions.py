"""``setup.py``'s caps against what users install beside us: ``pip install --dry-run --report`` of this checkout with
each target (TRL's vLLM extra, the vLLM release that pins the oldest transformers we accept, the newest
transformers), resolved against the real index, must succeed and pick the versions the caps are there for
(docs/compat.md); a negative control shows a cap that breaks a resolution fails it (ResolutionImpossible).

Fast and light: pip runs in this interpreter's environment without ``--ignore-installed`` (the installed torch and
transformers count, nothing is upgraded that need not be), ``--no-build-isolation`` (our metadata built with the
installed setuptools) and ``--use-feature=fast-deps``: the index here serves no PEP 658 metadata, so without it pip
downloads every wheel it considers in full (vLLM 0.34: 239 MB, torch 2.14.0: 555 MB, then its CUDA libraries); with
it, only each wheel's METADATA by HTTP range requests. The cases run side by side (network-bound): 80 s in all on 2
cores (2026-12-07). Skipped, saying so, only when the index can't be reached.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # subprocesses (pip)

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 480  # one resolution; 2026-12-07, 2 cores, side by side: 7-80 s at a load of 3, 24-243 s at 10-15


@dataclass(frozen=True)
class Case:
    name: str
    target: tuple[str, ...]  # what is installed beside ``-e <repo>``
    expect: dict[str, str]  # distribution -> regex its resolved version must match (the report, else installed)
    fresh: bool = False  # --ignore-installed: what a new environment would get
    # releases the target pins that the index lacks (flashinfer-python 0.7.3 is not on it: pip install vllm==0.34.0
    # fails there whatever our caps say); each becomes an empty local wheel, never one of CORE
    stubs: tuple[str, ...] = ()
    setup_py: str | None = None  # a replacement setup.py (the negative control)


CORE = {"torch", "transformers", "trl", "vllm", "accelerate", "datasets", "peft", "hf-sp-trainer", "tokenizers"}
CASES = [
    Case(
        "trl_vllm_extra",
        ("trl[vllm]==1.16.0",),
        # TRL's extra allows vllm 0.22..0.31; 0.31 needs transformers<5.18, 0.30 has no cap and pins torch 2.13.0
        {"vllm": r"0\.3[01]\.", "trl": r"1\.16\.0$", "transformers": r"5\.2[2-5]\.", "torch": r"2\.13\.0"},
    ),
    Case(
        "vllm_0_34",
        ("vllm==0.34.0",),
        # vLLM 0.34: transformers>=5.16.1,<5.23, torch==2.14.0: the reason our floor is 5.22
        {"vllm": r"0\.34\.0$", "transformers": r"5\.22\.", "torch": r"2\.14\.0$"},
        stubs=("flashinfer-python==0.7.3",),
    ),
    Case("transformers_5_25", ("transformers==5.25.0",), {"transformers": r"5\.25\.0$"}),
    Case("plain", (), {"transformers": r"5\.25\.", "torch": r"2\.1[3-5]\."}, fresh=True),
]


def hf_sp_setup_with(old: str, new: str) -> str:
    """Our setup.py with the requirement ``old`` replaced by ``new`` (the cap under test)."""
    text = (ROOT / "setup.py").read_text()
    assert f'"{old}"' in text, f"setup.py no longer has {old!r}: update the negative control"
    return text.replace(f'"{old}"', f'"{new}"')


# the negative control: the same runner, a floor of 5.24 (too new for vLLM 0.34's <5.23)
BROKEN = Case(
    "vllm_0_34_with_floor_5_24",
    ("vllm==0.34.0",),
    {},
    stubs=("flashinfer-python==0.7.3",),
    setup_py="transformers>=5.24,<5.25",
)


@dataclass
class Result:
    returncode: int
    output: str
    report: dict | None
    seconds: float


def index_url() -> str:
    """The index pip uses (``PIP_INDEX_URL``, pip's config, else PyPI)."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True
        )
        url = done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "https://pypi.org/simple"
    return url.rstrip("/")


@cache
def unreachable() -> str | None:
    """Why the index can't be reached (a page only it has: vllm's), or None."""
    url = f"{index_url()}/vllm/"
    if url.startswith("file:"):
        return None
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            response.read(1)
    except OSError as exc:
        return f"the package index {url} is unreachable ({exc}): the resolutions need it"
    return None


def stub_wheel(directory: Path, spec: str) -> None:
    """An empty wheel ``name==version`` in ``directory`` (a --find-links): a leaf the index lacks."""
    name, version = spec.split("==")
    assert name.lower().replace("_", "-") not in CORE, f"{name} must resolve from the index"
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests/test_resolutions.py\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(directory / f"{dist}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
        whl.writestr(f"{info}/RECORD", "".join(f"{p},,\n" for p in [*files, f"{info}/RECORD"]))


def project_copy(directory: Path, requirement: str) -> Path:
    """A copy of this project whose setup.py has ``requirement`` for transformers instead of ours (the package's
    sources are not needed to resolve: an empty ``hf_sp_trainer`` package)."""
    directory.mkdir(parents=True)
    old = next(r for r in install_requires() if r.startswith("transformers"))
    (directory / "setup.py").write_text(hf_sp_setup_with(old, requirement))
    shutil.copy(ROOT / "pyproject.toml", directory / "pyproject.toml")
    (directory / "hf_sp_trainer").mkdir()
    (directory / "hf_sp_trainer" / "__init__.py").write_text("")
    return directory


def install_requires() -> list[str]:
    """setup.py's ``install_requires`` (read from its AST)."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(e) for e in node.value.elts]
    raise AssertionError("setup.py has no install_requires")


def resolve(case: Case, tmp: Path) -> Result:
    """``pip install --dry-run --report`` of the project (ours, or the case's copy) with the case's target."""
    tmp.mkdir(parents=True, exist_ok=True)
    project = ROOT
    if case.setup_py is not None:
        project = project_copy(tmp / "project", case.setup_py)
    report = tmp / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report)]
    cmd += ["--no-build-isolation", "--use-feature=fast-deps", "--disable-pip-version-check", "--no-input"]
    if case.fresh:
        cmd.append("--ignore-installed")
    if case.stubs:
        (tmp / "stubs").mkdir(exist_ok=True)
        for spec in case.stubs:
            stub_wheel(tmp / "stubs", spec)
        cmd += ["--find-links", str(tmp / "stubs")]
    cmd += ["-e", str(project), *case.target]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp)
    loaded = json.loads(report.read_text()) if done.returncode == 0 and report.exists() else None
    return Result(done.returncode, done.stdout + done.stderr, loaded, time.time() - start)


def version_of(result: Result, name: str, fresh: bool) -> str | None:
    """The version pip would leave installed: the report's, else (not ``fresh``) the one installed here."""
    for item in result.report["install"]:
        if item["metadata"]["name"].lower().replace("_", "-") == name:
            return item["metadata"]["version"]
    if fresh:
        return None
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    """Every case and the negative control, resolved side by side (pip waits on the network, not the CPU)."""
    if why := unreachable():
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("resolutions")
    cases = [*CASES, BROKEN]
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        futures = {c.name: pool.submit(resolve, c, tmp / c.name) for c in cases}
        out = {name: f.result() for name, f in futures.items()}
    for name, r in out.items():
        picked = {i["metadata"]["name"]: i["metadata"]["version"] for i in (r.report or {}).get("install", [])}
        key = {n: picked[n] for n in ("vllm", "trl", "transformers", "torch") if n in picked}
        print(f"{name}: exit {r.returncode} in {r.seconds:.0f} s, {len(picked)} to install, {key}")
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_resolution(case: Case, results: dict[str, Result]) -> None:
    result = results[case.name]
    assert result.returncode == 0, (
        f"pip install --dry-run -e . {' '.join(case.target)} failed: setup.py's caps no longer allow it, or the "
        f"index lacks a release (then list it in the case's stubs):\n{result.output[-4000:]}"
    )
    assert any(i["metadata"]["name"].replace("_", "-") == "hf-sp-trainer" for i in result.report["install"]), (
        "the resolution does not include this project"
    )
    got = {name: version_of(result, name, case.fresh) for name in case.expect}
    wrong = {n: v for n, v in got.items() if v is None or not re.match(case.expect[n], v)}
    assert not wrong, f"{case.name}: resolved {got}, expected {case.expect}"


def test_a_cap_that_breaks_a_resolution_fails_it(results: dict[str, Result]) -> None:
    """The negative control: the runner, the vLLM 0.34 target and its stubs as above, our setup.py with
    ``transformers>=5.24,<5.25``: pip must find no resolution, because of transformers (not a missing release)."""
    result = results[BROKEN.name]
    assert result.returncode != 0, "a floor of 5.24 resolved beside vllm 0.34.0 (<5.23): the runner checks nothing"
    assert "ResolutionImpossible" in result.output, result.output[-4000:]
    conflict = r"Cannot install hf-sp-trainer==[^ ]*, vllm and vllm==0\.34\.0 because .* conflicting dependencies"
    assert re.search(conflict, result.output), result.output[-4000:]  # ours against vLLM's (transformers), not a gap
    assert results["vllm_0_34"].returncode == 0, "the control only counts beside the same target resolving"


@pytest.mark.unit
def test_install_requires_is_read() -> None:
    """The negative control edits the setup.py it reads (in process; here with its module's tier)."""
    reqs = install_requires()
    assert any(r.startswith("transformers>=") for r in reqs), reqs
    ours = next(r for r in reqs if r.startswith("transformers"))
    assert '"transformers>=5.24,<5.25"' in hf_sp_setup_with(ours, "transformers>=5.24,<5.25")
