"""``torch.compile`` with SP: the decoder layers compile in place, with no graph break inside a layer and one graph for
every layer and sequence length, and training stays exactly the single-process training (fp32, 1e-5).

The tests compile with the ``aot_eager`` backend (dynamo + AOT autograd, the parts that decide graph breaks and
recompilation; seconds instead of inductor's minutes on 2 CPU cores); ``scripts/bench_compile.py`` measures inductor's
speed and exactness.
"""

import contextlib

import pytest

from tests.harness import Case, assert_case, compare, run_cases, run_distributed, train_case, unwrap_results

pytestmark = pytest.mark.dist  # spawned gloo worlds (tests/pool.py)
COMPILE = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
KV1 = {"num_key_value_heads": 1}
CASES = [
    Case("compiled_llama_sp2", sp_overrides=COMPILE, steps=4, max_len=60),  # rows of varying length every step
    Case("compiled_ring2_kv1_ga2", grad_accum=2, sp_overrides=COMPILE | {"sp_ring_size": 2}, model_overrides=KV1),
    # the ring op's sinks input and gradient (gpt-oss: one sequence per batch, see test_equivalence_attention.py)
    Case(
        "compiled_ring2_gpt_oss_sinks",
        family="gpt_oss",
        attn="eager",
        batch_size=1,
        eval_batch_size=1,
        steps=4,
        sp_overrides=COMPILE | {"sp_ring_size": 2},
    ),  # fmt: skip
]
GRAPHS = {"compiled_ring2_gpt_oss_sinks": 6}  # sliding and full-attention layers compile apart (measured, torch 2.13)


@contextlib.contextmanager
def dynamo_counters(_case):
    """A ``run_cases`` probe: graph breaks and graphs compiled during the case."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    found: dict = {}
    try:
        yield found
    finally:
        found["graph_breaks"] = sum(counters["graph_break"].values())
        found["unique_graphs"] = counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def compiled():
    return unwrap_results(run_distributed(2, run_cases, CASES, dynamo_counters))[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled_layers_train_like_single_process(case, compiled, tmp_path):
    got = compiled[case.name]
    assert got["graph_breaks"] == 0, got["graph_breaks"]
    # one graph for every layer, step and length in training mode, and one in evaluation mode
    assert got["unique_graphs"] == GRAPHS.get(case.name, 2), got["unique_graphs"]
    ref = train_case(case, sp=False, out_dir=str(tmp_path))
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert_case(case, diffs, ref)
