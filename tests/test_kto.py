"""SPKTOTrainer trains exactly like trl.KTOTrainer: sp 2 on 2 gloo processes against one process, and dp 2 x sp 2 on
4 against TRL on 2 data-parallel processes (TRL pairs the KL completions within each rank's batch, so a data-parallel
run differs from one process by construction, with or without SP)."""

import pytest

from tests.preference_harness import WORLD2, WORLD4, check_case

pytestmark = pytest.mark.dist  # spawned gloo worlds (tests/pool.py)

CASES = [c for c in WORLD2 + WORLD4 if c.trainer == "kto"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sp_kto_matches_single_process(case):
    check_case(case)
