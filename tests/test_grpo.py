"""SPGRPOTrainer / SPRLOOTrainer on 2 gloo processes (sp 2) train exactly like single-process TRL (greedy)."""

import pytest

from tests.grpo_harness import CASES, TOL, sp_results, train_rl_case

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sp_rl_matches_single_process(case, tmp_path):
    from tests.harness import rel

    got = sp_results(case.world_size)[case.name]
    ref = train_rl_case(case, sp=False, out_dir=str(tmp_path))
    assert got["global_step"] == ref["global_step"] == case.steps
    diffs = {}
    for r, g in zip(ref["logs"], got["logs"], strict=True):
        for key, value in r.items():
            diffs[key] = max(diffs.get(key, 0.0), rel(g[key], value))
    p = torch_cat(got["params"])
    q = torch_cat(ref["params"])
    diffs["params"] = float((p - q).norm() / q.norm())
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    for key, value in diffs.items():
        assert value <= TOL, f"{case.name}: {key} differs by {value:.3e}"


def torch_cat(params):
    import torch

    return torch.cat([v.flatten().float() for _, v in sorted(params.items())])
