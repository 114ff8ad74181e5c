"""SPDPOTrainer on 2 and 4 gloo processes trains exactly like single-process trl.DPOTrainer."""

import pytest

from tests.preference_harness import WORLD2, WORLD4, check_case

pytestmark = pytest.mark.slow  # spawned process groups

CASES = [c for c in WORLD2 + WORLD4 if c.trainer == "dpo"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sp_dpo_matches_single_process(case, tmp_path):
    got = check_case(case, str(tmp_path))
    if case.sp_size == 4:
        assert got["prompt_only_shards"] > 0  # some rank held only prompt tokens of its batch


def test_long_context_dpo_recipe_smoke(tmp_path):
    """scripts/preference/qwen3-8b-lora-dpo-64k.sh with SMOKE=1: hf-sp-dpo launched on 2 CPU processes, sp_size 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "preference" / "qwen3-8b-lora-dpo-64k.sh"
    env = {
        **os.environ,
        "SMOKE": "1",
        "SMOKE_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "out" / "adapter_config.json").exists()  # a LoRA adapter was trained and saved
    assert "rewards/margins" in (tmp_path / "out" / "trainer_state.json").read_text()
