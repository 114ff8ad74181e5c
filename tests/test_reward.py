"""SPRewardTrainer on 2 and 4 gloo processes trains exactly like single-process trl.RewardTrainer."""

import pytest

from tests.preference_harness import WORLD2, WORLD4, check_case

pytestmark = pytest.mark.dist  # spawned gloo worlds (tests/pool.py)

CASES = [c for c in WORLD2 + WORLD4 if c.trainer == "reward"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sp_reward_matches_single_process(case):
    check_case(case)
