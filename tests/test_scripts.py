"""The CPU smoke variants of the launch scripts in scripts/lora/ and scripts/slurm/ (tiny model, 2 processes,
sp_size 2)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawned process groups / launched jobs

SCRIPTS = sorted(str(p) for p in (Path(__file__).parents[1] / "scripts" / "lora").glob("*.sh") if p.name[0] != "_")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: Path(s).stem)
def test_lora_script_smoke(script, tmp_path):
    env = {
        **os.environ,
        "SMOKE": "1",
        "SMOKE_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "out" / "adapter_config.json").exists()  # a LoRA adapter was trained and saved
    assert "Model saved to" in done.stdout


def test_scripts_found():
    assert len(SCRIPTS) == 3


def test_slurm_zero3_offload_smoke(tmp_path):
    """The SLURM example's recipe (torchrun, DeepSpeed ZeRO-3 with CPU offload, sp_size 2) on one CPU machine."""
    script = Path(__file__).parents[1] / "scripts" / "slurm" / "sft-zero3-offload.sbatch"
    env = {
        **os.environ,
        "SMOKE": "1",
        "SMOKE_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "out" / "trainer_state.json").exists()
