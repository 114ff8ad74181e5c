"""SPKTOTrainer on 2 gloo processes trains exactly like single-process trl.KTOTrainer.

Only sp_size=2 with dp=1: with dp > 1 TRL pairs the KL completions within each rank's batch, so a data-parallel run
differs from a single process by construction (with or without SP)."""

import pytest

from tests.preference_harness import WORLD2, check_case

pytestmark = pytest.mark.slow  # spawned process groups

CASES = [c for c in WORLD2 if c.trainer == "kto"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sp_kto_matches_single_process(case, tmp_path):
    check_case(case, str(tmp_path))
