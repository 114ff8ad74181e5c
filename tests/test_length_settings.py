"""Settings that switch on with sequence length, brought under the test rows, at Trainer level: SPTrainer on 2 and 4
gloo processes trains exactly like plain Trainer in one process.

- Llama-4: chunked attention (``attention_chunk_size`` 8 on rows of 6-40 tokens: every chunk boundary inside a
  document is a boundary for its chunked layers) and the NoPE layer's temperature (``floor_scale`` 4: the query
  scale changes every 4 positions, taken from each token's position in its document, not the shard's row index).
- Rotary embeddings whose frequencies follow the longest position of the call (dynamic NTK, longrope): one document
  of 30-40 tokens per step and a threshold of 24, so the first shard alone (positions < 20 at sp 2) would stay below
  it while one device crosses it. yarn / llama3 use their thresholds statically (the family suite crosses them).
"""

import pytest

from tests.harness import EXACT, Case, check_sp_case, sp_runs_by_world

pytestmark = pytest.mark.dist  # spawned gloo worlds (tests/pool.py)

RING2 = {"sp_ring_size": 2}
SGD = dict(optim="sgd", steps=3, train_overrides={"learning_rate": 0.05})
LLAMA4 = dict(family="llama4", model_overrides=dict(attention_chunk_size=8, floor_scale=4, attn_scale=1.0), **SGD)
ONE_LONG_DOCUMENT = dict(batch_size=1, grad_accum=2, min_len=30, max_len=40, eval_batch_size=1, **SGD)
DYNAMIC = dict(rope_type="dynamic", factor=8.0, rope_theta=10000.0)  # threshold: max_position_embeddings
LONGROPE = dict(
    rope_type="longrope",
    original_max_position_embeddings=24,
    short_factor=[1.0 + i / 8 for i in range(8)],
    long_factor=[2.0 + i / 4 for i in range(8)],
    rope_theta=10000.0,
)
PHI3_LONGROPE = dict(rope_parameters=LONGROPE, original_max_position_embeddings=24)  # Phi3's own field wins
WORLD2 = [
    Case("llama4_chunks_temperature", **LLAMA4),
    Case("ring2_llama4_chunks_temperature", **LLAMA4, sp_overrides=RING2),
    Case("llama_dynamic_ntk", model_overrides=dict(max_position_embeddings=24, rope_parameters=DYNAMIC),
         **ONE_LONG_DOCUMENT),
    Case("phi3_longrope", family="phi3", model_overrides=PHI3_LONGROPE, **ONE_LONG_DOCUMENT),
]  # fmt: skip
WORLD4 = [
    Case("sp4_llama4_chunks_temperature", **LLAMA4, sp_size=4, world_size=4),
    Case("hybrid2x2_llama4_chunks_temperature", **LLAMA4, sp_size=4, world_size=4, sp_overrides=RING2),
    Case("hybrid2x2_phi3_longrope", family="phi3", model_overrides=PHI3_LONGROPE,
         sp_size=4, world_size=4, sp_overrides=RING2, **ONE_LONG_DOCUMENT),
]  # fmt: skip


@pytest.fixture(scope="module")
def sp_results():
    return sp_runs_by_world(WORLD2, WORLD4)


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=lambda c: c.name)
def test_sp_matches_single_process(case, sp_results):
    check_sp_case(case, sp_results, EXACT)
