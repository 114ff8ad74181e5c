"""The CPU smoke variants (``SMOKE=1``: tiny model, 2 processes, sp_size 2) of every recipe in scripts/: LoRA SFT,
the SLURM ZeRO-3 example, LoRA DPO and LoRA GRPO."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launches import module_jobs, port_flags

pytestmark = pytest.mark.e2e  # launched jobs; the tests marked otherwise below are not

ROOT = Path(__file__).parents[1] / "scripts"
LORA = sorted(str(p) for p in (ROOT / "lora").glob("*.sh") if p.name[0] != "_")


def run_smoke(script: Path | str, smoke_dir: Path, flags: tuple[str, ...] = ()) -> str:
    """Run ``script`` with ``SMOKE=1`` (``flags`` appended to its command); it must exit 0. Returns its standard
    output."""
    env = {
        **os.environ,
        "SMOKE": "1",
        "SMOKE_DIR": str(smoke_dir),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(["bash", str(script), *flags], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def run_bench(script: str, out: Path) -> str:
    """``python scripts/<script> --smoke --out <out>``; it must exit 0. Returns its standard output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT.parent)}
    cmd = [sys.executable, str(ROOT / script), "--smoke", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _hf_sp(script: Path) -> Callable[[Path], str]:
    """An hf-sp-* recipe's smoke, on a rendezvous port of its own (it runs beside another job)."""
    return lambda out: run_smoke(script, out, tuple(port_flags("accelerate")))


# Every launched job of this module, by name (a test names its job with the `launches` marker)
JOBS: dict[str, Callable[[Path], str]] = {
    **{f"lora/{Path(s).stem}": _hf_sp(Path(s)) for s in LORA},
    "slurm": lambda out: run_smoke(ROOT / "slurm" / "sft-zero3-offload.sbatch", out),  # picks its own port
    "slurm_preemptible": lambda out: run_smoke(ROOT / "slurm" / "sft-preemptible.sbatch", out),  # its own port
    "dpo": _hf_sp(ROOT / "preference" / "qwen3-8b-lora-dpo-64k.sh"),
    "grpo": _hf_sp(ROOT / "grpo" / "qwen3-4b-lora-grpo-long-completions.sh"),
    "vlm": _hf_sp(ROOT / "vlm" / "qwen2.5-vl-7b-lora-multi-image-64k.sh"),
    "bench_hybrid": lambda out: run_bench("bench_hybrid.py", out),
    "bench_dsa": lambda out: run_bench("bench_dsa.py", out),
    "bench_dsa_kernel": lambda out: run_bench("bench_dsa_kernel.py", out),
    "bench_vlm_memory": lambda out: run_bench("bench_vlm_memory.py", out),
}


# The jobs whose recipe builds tiny assets (``python -m hf_sp_trainer.cli.tiny``): which ones, text or ``--vlm``
TINY = {name: "text" for name in (*(f"lora/{Path(s).stem}" for s in LORA), "slurm", "slurm_preemptible", "dpo", "grpo")}
TINY["vlm"] = "vlm"
_BUILDING = threading.Lock()  # the jobs run side by side: one builds, the other waits for it


def tiny_assets(root: Path, kind: str) -> Path:
    """The ``kind`` tiny assets under ``root``, built once by the recipes' own command in a fresh process."""
    with _BUILDING:
        if not (root / kind).exists():
            flags = ["--vlm"] if kind == "vlm" else []
            done = subprocess.run([sys.executable, "-m", "hf_sp_trainer.cli.tiny", str(root / kind), *flags],
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / kind


@pytest.fixture(scope="module")
def smokes(request, tmp_path_factory):
    """The jobs of this module's selected tests, started at its first such test, two at a time
    (``tests/launches.py``); ``smokes.result(name)``: the job's ``(stdout, output directory)``. The tiny assets a
    recipe builds are built once and copied into each job's directory: the recipe's build step finds them complete
    and keeps them (``hf_sp_trainer.cli.tiny``), instead of importing transformers to write the same files again."""
    dirs = {name: tmp_path_factory.mktemp(name.replace("/", "_")) for name in JOBS}
    shared = tmp_path_factory.mktemp("tiny_assets")

    def job(name: str):
        if name in TINY:
            shutil.copytree(tiny_assets(shared, TINY[name]), dirs[name], dirs_exist_ok=True)
        return JOBS[name](dirs[name]), dirs[name]

    runner = module_jobs(request, {name: (lambda n=name: job(n)) for name in JOBS})
    yield runner
    runner.close()


def logged(out: Path, key: str) -> list[int]:
    """The steps whose log entry has ``key``."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [e["step"] for e in history if key in e]


@pytest.mark.parametrize(
    "script",
    [pytest.param(s, marks=pytest.mark.launches(f"lora/{Path(s).stem}")) for s in LORA],
    ids=lambda s: Path(s).stem,
)
def test_lora_script_smoke(script, smokes):
    stdout, out = smokes.result(f"lora/{Path(script).stem}")
    assert (out / "out" / "adapter_config.json").exists()  # a LoRA adapter was trained and saved
    assert "Model saved to" in stdout


@pytest.mark.unit
def test_scripts_found():
    assert len(LORA) == 3


@pytest.mark.launches("slurm")
def test_slurm_zero3_offload_smoke(smokes):
    """The SLURM example's recipe (torchrun, DeepSpeed ZeRO-3 with CPU offload, sp_size 2) on one CPU machine."""
    _, out = smokes.result("slurm")
    assert (out / "out" / "trainer_state.json").exists()


@pytest.mark.launches("slurm_preemptible")
def test_slurm_preemptible_smoke(smokes):
    """The SLURM preemption example on one CPU machine: SIGTERM after the first checkpoint, the run saves and exits
    75, the script runs the job again, which resumes from the newest complete checkpoint and trains every step once."""
    stdout, out = smokes.result("slurm_preemptible")
    assert "training exited with 75" in stdout and "requeue" in stdout, stdout
    assert "resuming from" in stdout and stdout.rstrip().endswith("training exited with 0"), stdout
    assert logged(out / "out", "loss") == list(range(1, 25))


@pytest.mark.launches("dpo")
def test_long_context_dpo_recipe_smoke(smokes):
    """scripts/preference/qwen3-8b-lora-dpo-64k.sh: hf-sp-dpo launched on 2 CPU processes."""
    _, out = smokes.result("dpo")
    assert (out / "out" / "adapter_config.json").exists()
    assert logged(out / "out", "rewards/margins") == [1, 2]


@pytest.mark.launches("grpo")
def test_long_completion_grpo_recipe_smoke(smokes):
    """scripts/grpo/qwen3-4b-lora-grpo-long-completions.sh: hf-sp-grpo launched on 2 CPU processes, a reward
    function given as a dotted import path."""
    _, out = smokes.result("grpo")
    assert (out / "out" / "adapter_config.json").exists()
    assert logged(out / "out", "rewards/vowels/mean") == [1, 2]


@pytest.mark.launches("bench_hybrid")
def test_bench_hybrid_smoke(smokes):
    """scripts/bench_hybrid.py --smoke: one GDN layer, ours vs head-wise all-to-all on 2 CPU processes (the outputs
    must agree and the counted bytes match the formulas), and the tiny Qwen3.5 under SP vs one process."""
    stdout, out = smokes.result("bench_hybrid")
    (layer,) = json.loads((out / "hybrid_layer.json").read_text())["rows"]
    assert max(layer["out_rel"], layer["grad_rel"]) < 1e-4
    assert layer["ours_mb"] == pytest.approx(layer["ours_theory_mb"], rel=1e-6)
    assert layer["headwise_mb"] == pytest.approx(layer["headwise_theory_mb"], rel=1e-6)
    (model,) = json.loads((out / "hybrid_model.json").read_text())["rows"]
    assert model["loss_sp"] == pytest.approx(model["loss_single"], rel=1e-4)
    assert (out / "hybrid_bytes.csv").exists() and "| sp | length |" in stdout


@pytest.mark.launches("bench_dsa")
def test_bench_dsa_smoke(smokes):
    """scripts/bench_dsa.py --smoke: the DSA bytes table for the real shapes, and the bytes counted in a one-layer
    tiny DeepSeek-V3.2 step on 2 CPU processes equal to the formulas (all-to-alls, indexer keys, selections), at
    Ulysses 2 and at ring 2 (the all-gather path's K/V instead of the all-to-alls)."""
    _, out = smokes.result("bench_dsa")
    ulysses, ring = json.loads((out / "dsa_counted.json").read_text())["rows"]
    for check in (ulysses, ring):
        assert check["counted"] == check["formula"] and min(check["counted"].values()) > 0, check
    assert "all_to_all" in ulysses["counted"] and set(ring["counted"]) == {"ring_kv", "index_keys", "selections"}
    rows = json.loads((out / "dsa_bytes.json").read_text())["rows"]
    assert {r["model"] for r in rows} == {"deepseek_v32", "glm_moe_dsa", "axk2"} and all(
        r["dsa_over_a2a"] > 1 for r in rows
    )


@pytest.mark.launches("bench_dsa_kernel")
def test_bench_dsa_kernel_smoke(smokes):
    """scripts/bench_dsa_kernel.py --smoke: DSA's gathered and dense selected-keys kernels, forward and backward at
    two lengths, agree (the script exits non-zero otherwise) and both are timed."""
    stdout, out = smokes.result("bench_dsa_kernel")
    rows = json.loads((out / "dsa_kernel.json").read_text())["rows"]
    assert [r["seq"] for r in rows] == [256, 512] and all(r["dense_s"] > 0 and r["gathered_s"] > 0 for r in rows)
    assert all(float(r["max_rel_diff"]) <= 1e-5 for r in rows) and "| length | top-k |" in stdout


@pytest.mark.launches("vlm")
def test_vlm_lora_recipe_smoke(smokes):
    """scripts/vlm/qwen2.5-vl-7b-lora-multi-image-64k.sh: hf-sp-sft with a VLM (a tiny LLaVA saved like a hub
    checkpoint, its processor loaded by TRL) on TRL's vision conversations, 2 CPU processes, sp_size 2."""
    stdout, out = smokes.result("vlm")
    assert (out / "out" / "adapter_config.json").exists() and "Model saved to" in stdout
    assert logged(out / "out", "grad_norm") == [1, 2]


@pytest.mark.launches("bench_vlm_memory")
def test_bench_vlm_memory_smoke(smokes):
    """scripts/bench_vlm_memory.py --smoke: one long multimodal row of a Qwen2-VL-shaped model, an SPTrainer step at
    sp 1 and 2, per-rank peak measured; SP holds less per rank."""
    _, out = smokes.result("bench_vlm_memory")
    rows = json.loads((out / "vlm_memory.json").read_text())["rows"]
    assert [r["sp"] for r in rows] == [1, 2] and all(r["images"] > 0 and r["peak_mb"] > r["base_mb"] for r in rows)
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None  # the bench extra; CI installs test only
    assert (out / "vlm_memory.png").exists() == has_matplotlib
