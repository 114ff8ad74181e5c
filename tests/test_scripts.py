"""The CPU smoke variants (``SMOKE=1``: tiny model, 2 processes, sp_size 2) of every recipe in scripts/: LoRA SFT,
the SLURM ZeRO-3 example, LoRA DPO and LoRA GRPO."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # launched jobs; the tests marked otherwise below are not

ROOT = Path(__file__).parents[1] / "scripts"
LORA = sorted(str(p) for p in (ROOT / "lora").glob("*.sh") if p.name[0] != "_")


def run_smoke(script: Path | str, smoke_dir: Path) -> str:
    """Run ``script`` with ``SMOKE=1``; it must exit 0. Returns its standard output."""
    env = {
        **os.environ,
        "SMOKE": "1",
        "SMOKE_DIR": str(smoke_dir),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def logged(out: Path, key: str) -> list[int]:
    """The steps whose log entry has ``key``."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [e["step"] for e in history if key in e]


@pytest.mark.parametrize("script", LORA, ids=lambda s: Path(s).stem)
def test_lora_script_smoke(script, tmp_path):
    stdout = run_smoke(script, tmp_path)
    assert (tmp_path / "out" / "adapter_config.json").exists()  # a LoRA adapter was trained and saved
    assert "Model saved to" in stdout


@pytest.mark.unit
def test_scripts_found():
    assert len(LORA) == 3


def test_slurm_zero3_offload_smoke(tmp_path):
    """The SLURM example's recipe (torchrun, DeepSpeed ZeRO-3 with CPU offload, sp_size 2) on one CPU machine."""
    run_smoke(ROOT / "slurm" / "sft-zero3-offload.sbatch", tmp_path)
    assert (tmp_path / "out" / "trainer_state.json").exists()


def test_long_context_dpo_recipe_smoke(tmp_path):
    """scripts/preference/qwen3-8b-lora-dpo-64k.sh: hf-sp-dpo launched on 2 CPU processes."""
    run_smoke(ROOT / "preference" / "qwen3-8b-lora-dpo-64k.sh", tmp_path)
    assert (tmp_path / "out" / "adapter_config.json").exists()
    assert logged(tmp_path / "out", "rewards/margins") == [1, 2]


def test_long_completion_grpo_recipe_smoke(tmp_path):
    """scripts/grpo/qwen3-4b-lora-grpo-long-completions.sh: hf-sp-grpo launched on 2 CPU processes, a reward
    function given as a dotted import path."""
    run_smoke(ROOT / "grpo" / "qwen3-4b-lora-grpo-long-completions.sh", tmp_path)
    assert (tmp_path / "out" / "adapter_config.json").exists()
    assert logged(tmp_path / "out", "rewards/vowels/mean") == [1, 2]


def test_bench_hybrid_smoke(tmp_path):
    """scripts/bench_hybrid.py --smoke: one GDN layer, ours vs head-wise all-to-all on 2 CPU processes (the outputs
    must agree and the counted bytes match the formulas), and the tiny Qwen3.5 under SP vs one process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT.parent)}
    cmd = [sys.executable, str(ROOT / "bench_hybrid.py"), "--smoke", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (layer,) = json.loads((tmp_path / "hybrid_layer.json").read_text())["rows"]
    assert max(layer["out_rel"], layer["grad_rel"]) < 1e-4
    assert layer["ours_mb"] == pytest.approx(layer["ours_theory_mb"], rel=1e-6)
    assert layer["headwise_mb"] == pytest.approx(layer["headwise_theory_mb"], rel=1e-6)
    (model,) = json.loads((tmp_path / "hybrid_model.json").read_text())["rows"]
    assert model["loss_sp"] == pytest.approx(model["loss_single"], rel=1e-4)
    assert (tmp_path / "hybrid_bytes.csv").exists() and "| sp | length |" in done.stdout


def test_bench_dsa_smoke(tmp_path):
    """scripts/bench_dsa.py --smoke: the DSA bytes table for the real shapes, and the bytes counted in a one-layer
    tiny DeepSeek-V3.2 step on 2 CPU processes equal to the formulas (all-to-alls, indexer keys, selections)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT.parent)}
    cmd = [sys.executable, str(ROOT / "bench_dsa.py"), "--smoke", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (check,) = json.loads((tmp_path / "dsa_counted.json").read_text())["rows"]
    assert check["counted"] == check["formula"] and min(check["counted"].values()) > 0
    rows = json.loads((tmp_path / "dsa_bytes.json").read_text())["rows"]
    assert {r["model"] for r in rows} == {"deepseek_v32", "glm_moe_dsa", "axk2"} and all(
        r["dsa_over_a2a"] > 1 for r in rows
    )


def test_vlm_lora_recipe_smoke(tmp_path):
    """scripts/vlm/qwen2.5-vl-7b-lora-multi-image-64k.sh: hf-sp-sft with a VLM (a tiny LLaVA saved like a hub
    checkpoint, its processor loaded by TRL) on TRL's vision conversations, 2 CPU processes, sp_size 2."""
    stdout = run_smoke(ROOT / "vlm" / "qwen2.5-vl-7b-lora-multi-image-64k.sh", tmp_path)
    assert (tmp_path / "out" / "adapter_config.json").exists() and "Model saved to" in stdout
    assert logged(tmp_path / "out", "grad_norm") == [1, 2]


def test_bench_vlm_memory_smoke(tmp_path):
    """scripts/bench_vlm_memory.py --smoke: one long multimodal row of a Qwen2-VL-shaped model, an SPTrainer step at
    sp 1 and 2, per-rank peak measured; SP holds less per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT.parent)}
    cmd = [sys.executable, str(ROOT / "bench_vlm_memory.py"), "--smoke", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "vlm_memory.json").read_text())["rows"]
    assert [r["sp"] for r in rows] == [1, 2] and all(r["images"] > 0 and r["peak_mb"] > r["base_mb"] for r in rows)
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None  # the bench extra; CI installs test only
    assert (tmp_path / "vlm_memory.png").exists() == has_matplotlib
