"""SPDPOTrainer on 2 and 4 gloo processes trains exactly like single-process trl.DPOTrainer."""

import pytest

from tests.preference_harness import WORLD2, WORLD4, check_case

pytestmark = pytest.mark.dist  # spawned gloo worlds (tests/pool.py)

CASES = [c for c in WORLD2 + WORLD4 if c.trainer == "dpo"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sp_dpo_matches_single_process(case):
    got = check_case(case)
    if case.sp_size == 4:
        assert got["prompt_only_shards"] > 0  # some rank held only prompt tokens of its batch
