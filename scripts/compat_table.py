"""The family suite on every tested transformers minor: ``docs/compat/models-<minor>.md`` and ``docs/compat.md``.

For each minor (its newest patch), builds or reuses a venv ``<venv-root>/tf-<minor>`` (``python3 -m venv``;
torch, ``--no-build-isolation`` DeepSpeed, ``pip install -e <repo>[test] transformers==<version>``), runs the family
suite there (``tests/test_model_families.py``'s ``run_outcomes`` / ``run_ring_outcomes`` and
``tests.multimodal_harness.classify_vlms``, rendered by its ``render``: the table of ``docs/models.md``), and writes

- ``docs/compat/models-<minor>.md``: that minor's table;
- ``docs/compat/outcomes-<minor>.json``: the outcomes it was rendered from (the summary reads these);
- ``docs/compat.md``: per minor the counts (exact / refused / out of scope / ...), then every family whose
  classification differs between minors, and every family that is neither exact, refused nor out of scope.

About 10 minutes per minor on 2 CPU cores (plus a few minutes for a new venv). The summary covers every
``outcomes-*.json`` present, so one minor can be rerun alone.

    python scripts/compat_table.py                              # 5.22, 5.23, 5.24, 5.25
    python scripts/compat_table.py --minors 5.22,5.23 --venv-root /work/venvs
    python scripts/compat_table.py --minors 5.26.0               # a new release: the full version names the patch
    python scripts/compat_table.py --summary-only                # docs/compat.md from the JSON files present

The procedure for a new minor (venv, contract tests, unit tier, this script): ``scripts/follow_transformers.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
OUT_DIR = os.path.join(DOCS, "compat")
SUMMARY = os.path.join(DOCS, "compat.md")
# the newest patch of each tested minor (setup.py: transformers>=5.22,<5.26)
NEWEST_PATCH = {"5.22": "5.22.2", "5.23": "5.23.0", "5.24": "5.24.0", "5.25": "5.25.0"}
TORCH = "2.13.0"  # CI's torch (a local CPU wheel on the CI machine)
DEEPSPEED = "0.19.8"
STATUSES = ("exact", "refused", "out of scope", "can't build", "nothing to cross", "wrong", "crash")
FINE = ("exact", "refused", "out of scope", "can't build", "nothing to cross")  # what the suite accepts
CLASSIFIED = ("exact", "refused", "out of scope", "nothing to cross")  # the rest is listed under the failures
REGENERATE = "python scripts/compat_table.py --minors 5.22,5.23,5.24,5.25"
sys.path.insert(0, ROOT)  # tests/doc_links.py (no third-party imports: this script runs outside the venvs)
from tests.doc_links import relink  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------
# inside a minor's venv: run the suite, dump the outcomes
# ----------------------------------------------------------------------------------------------------------------
def dump(json_path: str, md_path: str) -> int:
    """Run the family suite with the installed transformers; write its rendered table and the outcomes as JSON."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    data: dict = {"transformers": transformers.__version__, "torch": torch.__version__, "errors": {}}
    start = time.time()
    try:
        from tests.multimodal_harness import classify_vlms
        from tests.test_model_families import FAMILIES, render, run_outcomes, run_ring_outcomes
    except Exception:  # noqa: BLE001 - the suite doesn't import: that is the finding
        data["errors"]["import"] = traceback.format_exc()
        _write_json(json_path, data)
        return 1
    stages = {"outcomes": run_outcomes, "ring": run_ring_outcomes, "vlms": classify_vlms}
    got: dict = {}
    for name, fn in stages.items():
        t0 = time.time()
        try:
            got[name] = fn()
        except Exception:  # noqa: BLE001 - recorded, the other stages still run
            data["errors"][name] = traceback.format_exc()
        data[f"{name}_seconds"] = round(time.time() - t0, 1)
    outcomes, ring, vlms = got.get("outcomes"), got.get("ring"), got.get("vlms")
    rows = []
    for f in FAMILIES:
        row = {"model_type": f.model_type, "class_name": f.class_name}
        if f.out_of_scope:
            row.update(status="out of scope", detail=f.out_of_scope)
        elif outcomes is None:
            row.update(status="not run", detail="the family group failed")
        else:
            default, crossed = outcomes["default"].get(f.model_type), outcomes["crossed"].get(f.model_type)
            row.update(status=default["status"], detail=default["detail"])
            if crossed is not None:
                row.update(crossed_status=crossed["status"], crossed_detail=crossed["detail"])
        rows.append(row)
    data["families"] = rows
    data["ring"] = None
    if ring:
        data["ring"] = [
            {"model_type": t, "status": o["status"], "detail": o["detail"]}
            | {f"crossed_{k}": ring["crossed"][t][k] for k in ("status", "detail") if t in ring.get("crossed", {})}
            for t, o in ring["default"].items()
        ]
    data["vlms"] = (
        None if vlms is None else [{"model_type": t, "class_name": c, "status": s, "detail": d} for t, c, s, d in vlms]
    )
    if outcomes is not None and ring is not None and vlms is not None:
        try:
            text = render(outcomes, ring, vlms)
        except Exception:  # noqa: BLE001
            data["errors"]["render"] = traceback.format_exc()
        else:
            with open(md_path, "w") as f:
                f.write(text)
    data["seconds"] = round(time.time() - start, 1)
    _write_json(json_path, data)
    return 1 if data["errors"] else 0


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------------------------------------------
# outside: the venvs
# ----------------------------------------------------------------------------------------------------------------
def parse_minors(text: str) -> list[tuple[str, str]]:
    """``5.22,5.23`` (the newest patch of each: NEWEST_PATCH, else asked of the index) or ``5.26.0`` (that version)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(".")
        if len(parts) >= 3:
            out.append((".".join(parts[:2]), item))
        elif item in NEWEST_PATCH:
            out.append((item, NEWEST_PATCH[item]))
        else:
            out.append((item, newest_patch(item)))
    return out


def newest_patch(minor: str) -> str:
    """The newest released ``minor.*`` of transformers on the index (``pip index versions``)."""
    from packaging.version import Version

    text = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "transformers"], capture_output=True, text=True, check=True
    ).stdout
    versions = [v.strip() for v in text.split("Available versions:", 1)[1].splitlines()[0].split(",")]
    mine = [Version(v) for v in versions if v.startswith(minor + ".") and not Version(v).is_prerelease]
    if not mine:
        raise SystemExit(f"no transformers {minor}.x on the index: {text.splitlines()[0]}")
    return str(max(mine))


def installed(python: str, package: str) -> str | None:
    result = subprocess.run(
        [python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"], capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else None


def ensure_venv(venv: str, version: str, torch: str, deepspeed: str, log) -> str:
    """``venv``'s python with transformers ``version``, hf_sp_trainer (editable, this checkout), torch, DeepSpeed."""
    python = os.path.join(venv, "bin", "python")

    def pip(*args: str) -> None:
        cmd = [python, "-m", "pip", "install", *args]
        log(f"$ {' '.join(cmd)}")
        t0 = time.time()
        subprocess.run(cmd, check=True, stdout=LOG_FILE, stderr=subprocess.STDOUT)
        log(f"  ({time.time() - t0:.0f} s)")

    if not os.path.exists(python):
        log(f"$ python3 -m venv {venv}")
        subprocess.run(["python3", "-m", "venv", venv], check=True)
    if installed(python, "torch") is None or not installed(python, "torch").startswith(torch):
        pip(f"torch=={torch}")
    if installed(python, "deepspeed") != deepspeed:
        pip("--no-build-isolation", f"deepspeed=={deepspeed}")
    # also when all is there: the editable install follows the checkout, but setup.py's requirements may have moved
    try:
        pip("-e", f"{ROOT}[test]", f"transformers=={version}", f"torch=={torch}")
    except subprocess.CalledProcessError:
        # a release past setup.py's cap (scripts/follow_transformers.sh): our requirements, then that transformers
        # over them (pip warns that hf_sp_trainer requires an older one; that is the point)
        log(f"  transformers {version} does not resolve with setup.py's caps: installing it over them")
        pip("-e", f"{ROOT}[test]", f"torch=={torch}")
        pip(f"transformers=={version}", f"torch=={torch}")
    if installed(python, "transformers") != version:
        raise SystemExit(f"{venv}: transformers {installed(python, 'transformers')} installed, not {version}")
    return python


LOG_FILE = None


def run_minor(minor: str, version: str, args, log) -> dict:
    venv = os.path.join(args.venv_root, f"tf-{minor}")
    os.makedirs(OUT_DIR, exist_ok=True)
    json_path = os.path.join(OUT_DIR, f"outcomes-{minor}.json")
    md_path = os.path.join(OUT_DIR, f"models-{minor}.md")
    t0 = time.time()
    python = venv_python = os.path.join(venv, "bin", "python")
    if not args.skip_build:
        python = ensure_venv(venv, version, args.torch, args.deepspeed, log)
    elif not os.path.exists(venv_python):
        raise SystemExit(f"--skip-build: no venv at {venv}")
    build_s = time.time() - t0
    log(f"transformers {version}: venv ready in {build_s:.0f} s; the family suite ...")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    t1 = time.time()
    result = subprocess.run(
        [python, os.path.abspath(__file__), "--dump", json_path, md_path],
        cwd=ROOT,
        env=env,
        stdout=LOG_FILE,
        stderr=subprocess.STDOUT,
    )
    suite_s = time.time() - t1
    if os.path.exists(md_path):  # the table's relative links are docs/'s: from docs/compat/ they go one up
        with open(md_path) as f:
            text = relink(f.read())
        with open(md_path, "w") as f:
            f.write(text)
    if os.path.exists(json_path):
        with open(json_path) as f:
            data = json.load(f)
    else:
        data = {"transformers": version, "errors": {"dump": f"exit {result.returncode}, no JSON (see the log)"}}
    data.update(minor=minor, venv_seconds=round(build_s, 1), suite_seconds=round(suite_s, 1))
    _write_json(json_path, data)
    log(f"transformers {version}: family suite {suite_s:.0f} s, exit {result.returncode}; {counts_text(data)}")
    return data


# ----------------------------------------------------------------------------------------------------------------
# the summary
# ----------------------------------------------------------------------------------------------------------------
def counts(rows: list[dict] | None) -> Counter:
    return Counter(r["status"] for r in rows or [])


def counts_text(data: dict) -> str:
    c = counts(data.get("families"))
    return ", ".join(f"{s} {c[s]}" for s in STATUSES if c.get(s)) or "no outcomes"


def _key(minor: str) -> tuple[int, ...]:
    return tuple(int(p) for p in minor.split("."))


def _cell(row: dict | None) -> str:
    if row is None:
        return "absent"
    text = row["status"]
    if row.get("crossed_status") and row["crossed_status"] not in (row["status"], "nothing to cross"):
        text += f" (crossed: {row['crossed_status']})"
    return text


def _reason(row: dict | None) -> str:
    if row is None or row["status"] == "exact" and row.get("crossed_status") in (None, "exact", "nothing to cross"):
        return ""
    parts = [row.get("detail") or ""] if row["status"] != "exact" else []
    if row.get("crossed_status") not in (None, row["status"], "nothing to cross", "exact"):
        parts.append(f"crossed: {row.get('crossed_detail', '')}")
    return "; ".join(p for p in parts if p)


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _differences(title: str, per_minor: dict[str, list[dict] | None], minors: list[str], key=_cell) -> list[str]:
    table = {m: {r["model_type"]: r for r in rows} for m, rows in per_minor.items() if rows is not None}
    names = sorted({t for rows in table.values() for t in rows})
    lines = [f"### {title}", ""]
    diff = []
    for name in names:
        cells = [key(table[m].get(name)) if m in table else "not run" for m in minors]
        ran = [c for c in cells if c != "not run"]
        if len(set(ran)) > 1:
            reasons = "; ".join(
                f"{m}: {_reason(table[m].get(name))}" for m in minors if m in table and _reason(table[m].get(name))
            )
            diff.append(f"| `{name}` | " + " | ".join(cells) + f" | {_esc(reasons)} |")
    if not diff:
        return lines + ["None: every one is classified alike on every minor run.", ""]
    return lines + [
        "| model type | " + " | ".join(minors) + " | reasons (refusals, errors) |",
        "| --- | " + " | ".join("---" for _ in minors) + " | --- |",
        *diff,
        "",
    ]


def summary(out_dir: str = OUT_DIR) -> str:
    data = {}
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if name.startswith("outcomes-") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                data[name[len("outcomes-") : -len(".json")]] = json.load(f)
    minors = sorted(data, key=_key)
    lines = [
        "# Compatibility: the family suite on each transformers minor",
        "",
        f"Generated by `{REGENERATE}` (`scripts/compat_table.py`; `--summary-only` rewrites this file from the "
        "`docs/compat/outcomes-<minor>.json` present, `--minors 5.24` reruns one minor). Each minor runs in its "
        "own venv (`/work/venvs/tf-<minor>` by default, `--venv-root`): torch, DeepSpeed, this checkout editable "
        "and the minor's newest patch of transformers; the suite is `tests/test_model_families.py`'s, its table "
        "per minor in `docs/compat/models-<minor>.md` (what `docs/models.md` is for the installed version).",
        "",
        "A new transformers minor: `scripts/follow_transformers.sh <version>` builds its venv, runs the contract "
        "tests (`tests/test_upstream_contract.py`) and the unit tier there, then this script for that minor, and "
        "prints the `setup.py` cap to change ([testing.md](testing.md#following-transformers-releases)).",
        "",
        "## Counts (causal LMs, default configs)",
        "",
        "| minor | transformers | torch | " + " | ".join(STATUSES) + " | ring sample | VLMs | table | suite s |",
        "| --- | --- | --- | " + " | ".join("---" for _ in STATUSES) + " | --- | --- | --- | --- |",
    ]
    for m in minors:
        d = data[m]
        c = counts(d.get("families"))
        ring = ", ".join(f"{s} {n}" for s, n in sorted(counts(d.get("ring")).items())) or "-"
        vlms = ", ".join(f"{s} {n}" for s, n in sorted(counts(d.get("vlms")).items())) or "-"
        table = f"[models-{m}.md](compat/models-{m}.md)"
        if not os.path.exists(os.path.join(out_dir, f"models-{m}.md")):
            table = "-"
        lines.append(
            f"| {m} | {d.get('transformers', '?')} | {d.get('torch', '?')} | "
            + " | ".join(str(c.get(s, 0)) for s in STATUSES)
            + f" | {ring} | {vlms} | {table} | {d.get('suite_seconds', d.get('seconds', '?'))} |"
        )
    lines += ["", "## Differences between minors", ""]
    lines += _differences("Causal LMs", {m: data[m].get("families") for m in minors}, minors)
    lines += _differences("Ring sample (sp 4 = Ulysses 2 x ring 2)", {m: data[m].get("ring") for m in minors}, minors)
    lines += _differences("Vision-language models", {m: data[m].get("vlms") for m in minors}, minors)
    lines += [
        "## Neither exact, refused nor out of scope, and errors",
        "",
        "*crash* and *wrong* fail the family suite; *can't build* (the tiny model, or its one-process reference, "
        "raised before SP was involved) passes it, listed here because a new minor's can't-build is often an "
        "upstream signature change.",
        "",
    ]
    bad = []
    for m in minors:
        d = data[m]
        for part in ("families", "ring", "vlms"):
            for r in d.get(part) or []:
                for variant, status, detail in (
                    ("default", r["status"], r.get("detail", "")),
                    ("crossed", r.get("crossed_status"), r.get("crossed_detail", "")),
                ):
                    if status is not None and status not in CLASSIFIED:
                        bad.append(f"| {m} | {part} | `{r['model_type']}` | {variant} | {status} | {_esc(detail)} |")
        for stage, tb in (d.get("errors") or {}).items():
            last = [ln for ln in tb.strip().splitlines() if ln.strip()][-1:] or [""]
            bad.append(f"| {m} | {stage} | - | - | error | {_esc(last[0])} |")
    if bad:
        lines += ["| minor | part | model type | config | status | detail |", "| --- | --- | --- | --- | --- | --- |"]
        lines += bad
    else:
        lines.append("None.")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global LOG_FILE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minors", default=",".join(NEWEST_PATCH), help="5.22,5.23 or a full version (5.26.0)")
    parser.add_argument("--venv-root", default=os.environ.get("HF_SP_VENV_ROOT", "/work/venvs"))
    parser.add_argument("--torch", default=TORCH)
    parser.add_argument("--deepspeed", default=DEEPSPEED)
    parser.add_argument("--skip-build", action="store_true", help="use the venvs as they are")
    parser.add_argument("--summary-only", action="store_true", help="rewrite docs/compat.md from the JSON present")
    parser.add_argument("--dump", nargs=2, metavar=("JSON", "MD"), help=argparse.SUPPRESS)  # inside a venv
    args = parser.parse_args(argv)
    if args.dump:
        return dump(*args.dump)

    def log(text: str) -> None:
        print(f"[compat {time.strftime('%H:%M:%S')}] {text}", flush=True)

    status = 0
    if not args.summary_only:
        os.makedirs(args.venv_root, exist_ok=True)
        for minor, version in parse_minors(args.minors):
            log_path = os.path.join(args.venv_root, f"tf-{minor}.log")
            with open(log_path, "a") as LOG_FILE:
                log(f"transformers {version} (log: {log_path})")
                data = run_minor(minor, version, args, log)
            bad = [r for r in data.get("families") or [] if r["status"] not in FINE]
            if data.get("errors") or bad:
                status = 1
    with open(SUMMARY, "w") as f:
        f.write(summary())
    log(f"wrote {os.path.relpath(SUMMARY, ROOT)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
