"""Run the numeric tiers under several fp32 round-off profiles of this machine and tabulate the exactness verdicts.

torch picks its CPU kernels at run time (``ATEN_CPU_CAPABILITY``), and MKL / oneDNN can be capped the same way
(``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``): each changes summation orders as another host's CPU does. Every
run appends each verdict of ``tests/exactness.py`` (the family suite, the VLM matrix, the Trainer-level cases) to a
JSON-lines log (``HF_SP_EXACTNESS_LOG``); the table gives per profile the runs, the tests failed, the worst fp32 gap,
how many comparisons needed their float64 run past ``EXACT``, and the comparisons closest to their bar.

    python scripts/exactness_profiles.py                                  # every profile, 3 runs, `-m "not e2e"`
    python scripts/exactness_profiles.py --profiles mkl-avx2 --runs 1 --select all   # the README's whole suite
    python scripts/exactness_profiles.py --profiles native avx2 --runs 1 --select "dist or matrix"
    python scripts/exactness_profiles.py --table-only                     # re-tabulate the logs in --out

Writes ``--out`` (default ``runs/exactness``, ignored by git): ``<profile>-<run>.jsonl`` (verdicts),
``<profile>-<run>.log`` (pytest's output), ``summary.json`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PROFILES = {
    "native": {},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx2-host": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
CLOSEST = 8  # comparisons listed per profile, closest to their bar first


def run(profile: str, index: int, select: str, out: str) -> dict:
    """One pytest run of the tests ``select`` picks under ``profile``; its verdict log, output and counts."""
    log, output = (os.path.join(out, f"{profile}-{index}.{ext}") for ext in ("jsonl", "log"))
    if os.path.exists(log):
        os.remove(log)
    env = os.environ | PROFILES[profile] | {"OMP_NUM_THREADS": "1"}  # the tier budgets enforced (host-scaled)
    env |= {"HF_SP_EXACTNESS_LOG": os.path.abspath(log)}
    command = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"]
    command += ["-m", select] if select != "all" else []
    start = time.time()
    with open(output, "w") as f:
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    text = open(output).read()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", text.splitlines()[-1])}
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in text.splitlines() if line.startswith("FAILED ")]
    return {"profile": profile, "run": index, "exit": code, "seconds": round(time.time() - start), **counts,
            "failed_tests": failed}  # fmt: skip


def margin(verdict: dict) -> float:
    """How close a comparison came to its bar (1: at it): fp32 over ``EXACT``, or over the round-off bar."""
    from tests.exactness import EXACT, ROUND_OFF_MULTIPLE

    if verdict.get("round_off") is None:
        return verdict["fp32"] / EXACT
    return verdict["fp32"] / max(EXACT, ROUND_OFF_MULTIPLE * verdict["round_off"])


def tabulate(out: str, runs: list[dict]) -> dict:
    from tests.exactness import EXACT

    summary = {}
    for profile in PROFILES:
        logs = sorted(glob.glob(os.path.join(out, f"{profile}-*.jsonl")))
        if not logs:
            continue
        logged = [json.loads(line) for path in logs for line in open(path)]
        verdicts = [v for v in logged if not v.get("control")]  # the negative controls: counted apart
        controls = [v for v in logged if v.get("control")]
        worst: dict[str, dict] = {}
        for v in verdicts:  # per comparison, its worst run
            if v["name"] not in worst or margin(v) > margin(worst[v["name"]]):
                worst[v["name"]] = v
        closest = sorted(worst.values(), key=margin, reverse=True)[:CLOSEST]
        mine = [r for r in runs if r["profile"] == profile]
        summary[profile] = {
            "switches": PROFILES[profile],
            "runs": len(logs),
            "comparisons": len(verdicts),
            "not_exact": sorted({v["name"] for v in verdicts if not v["exact"]}),
            "controls_caught": f"{sum(not v['exact'] for v in controls)} of {len(controls)}",
            "past_exact": len({v["name"] for v in verdicts if v["fp32"] > EXACT}),
            "worst_fp32": max(v["fp32"] for v in verdicts),
            "same_every_run": all(len({(v["fp32"]) for v in verdicts if v["name"] == n}) == 1 for n in worst),
            "closest": [
                {
                    "name": v["name"],
                    "fp32": v["fp32"],
                    "round_off": v.get("round_off"),
                    "float64": v.get("float64"),
                    "of_bar": round(margin(v), 3),
                }
                for v in closest
            ],  # fmt: skip
            "pytest": mine,
        }
    return summary


def markdown(summary: dict) -> str:
    lines = ["| profile | runs | comparisons | not exact | past 1e-5 (float64 run) | worst fp32 | same every run | "
             "negative controls caught |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for profile, s in summary.items():
        lines.append(f"| {profile} | {s['runs']} | {s['comparisons']} | {len(s['not_exact'])} | {s['past_exact']} | "
                     f"{s['worst_fp32']:.2e} | {s['same_every_run']} | {s['controls_caught']} |")  # fmt: skip
    for profile, s in summary.items():
        lines += ["", f"**{profile}** closest to their bar:", ""]
        lines += [f"- {c['name']}: fp32 {c['fp32']:.2e}, {c['of_bar']:.2f} of its bar" for c in s["closest"]]
        for r in s["pytest"]:
            failed = f", failed: {', '.join(r['failed_tests'])}" if r["failed_tests"] else ""
            lines.append(f"- run {r['run']}: {r.get('passed', 0)} passed, {r.get('failed', 0)} failed, "
                         f"{r.get('skipped', 0)} skipped in {r['seconds']} s{failed}")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--select", default="not e2e", help="pytest -m expression (default: every in-process and gloo tier)"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "exactness"))
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs_file = os.path.join(args.out, "runs.json")
    runs = json.load(open(runs_file)) if os.path.exists(runs_file) else []
    if not args.table_only:
        for index in range(1, args.runs + 1):
            for profile in args.profiles:
                result = run(profile, index, args.select, args.out)
                runs = [r for r in runs if (r["profile"], r["run"]) != (profile, index)] + [result]
                json.dump(runs, open(runs_file, "w"), indent=1)
                print(json.dumps({k: v for k, v in result.items() if k != "failed_tests"}), flush=True)
    summary = tabulate(args.out, runs)
    json.dump(summary, open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    text = markdown(summary)
    open(os.path.join(args.out, "summary.md"), "w").write(text)
    print(text)
    return int(any(s["not_exact"] or any(r["failed_tests"] for r in s["pytest"]) for s in summary.values()))


if __name__ == "__main__":
    sys.exit(main())
