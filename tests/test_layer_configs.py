"""Heterogeneous configs (transformers' ``per_layer_config``): SP reads every layer's heads, and Gemma4 — per-layer
head sizes and kv heads, per-layer embeddings, kv shared across layers — trains under SPTrainer on 2 and 4 gloo
processes exactly like plain Trainer in one process."""

import pytest
import torch

from hf_sp_trainer import apply_sequence_parallel
from hf_sp_trainer.integrations.throughput import attention_geometry
from hf_sp_trainer.model.heads import AttentionShape, attention_shapes, head_counts
from hf_sp_trainer.planner import ModelShape
from hf_sp_trainer.validate import validate_model_for_sp
from tests.harness import EXACT, Case, check_sp_case, sp_runs_by_world, tiny_model

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1)  # full-attention layers: 1 kv head, v = k
SGD = dict(optim="sgd", family="gemma4")
WORLD2 = [
    Case("gemma4_shared_kv", **SGD),
    Case("gemma4_k_eq_v_ring2", **SGD, model_overrides=K_EQ_V, sp_overrides={"sp_ring_size": 2}),
]
WORLD4 = [
    Case("sp4_gemma4_k_eq_v", **SGD, sp_size=4, world_size=4, model_overrides=K_EQ_V),  # 1 and 2 kv heads, 4 ranks
    Case("hybrid2x2_gemma4", **SGD, sp_size=4, world_size=4, sp_overrides={"sp_ring_size": 2}),
]


def test_attention_shapes_per_layer():
    model = tiny_model("gemma4", **K_EQ_V)
    assert model.config.is_heterogeneous
    assert attention_shapes(model.config) == [AttentionShape(4, 2, 16), AttentionShape(4, 1, 32)] * 2
    assert head_counts(model.config) == (4, 1)
    assert attention_geometry(model.config) == (4, 4 * (16 + 32) // 2)
    assert validate_model_for_sp(model, 4) == (4, 1)
    homogeneous = tiny_model("llama")
    assert attention_shapes(homogeneous.config) == [AttentionShape(4, 2, 16)] * 2


def test_a_layer_whose_heads_dont_split_is_refused():
    model = tiny_model("gemma4", attention_k_eq_v=True, num_global_key_value_heads=3)
    with pytest.raises(ValueError, match="layer 1 has 4 query heads, not a multiple of its 3 kv heads"):
        validate_model_for_sp(model, 2)
    with pytest.raises(ValueError, match="layer 1 has 4 query heads"):
        apply_sequence_parallel(model, 2)  # before any process group is needed


def test_planner_refuses_per_layer_shapes():
    with pytest.raises(ValueError, match=r"\['head_dim'\] per layer"):
        ModelShape.from_config(tiny_model("gemma4").config)


def test_tiny_gemma4_has_the_features_under_test():
    """Negative control: the shared-kv layers really reuse the k/v of earlier layers (no k/v projections of their
    own), the full-attention layers' head size differs, and the per-layer embeddings feed every layer."""
    model = tiny_model("gemma4")
    layers = model.model.layers
    assert [layer.self_attn.is_kv_shared_layer for layer in layers] == [False, False, True, True]
    assert not hasattr(layers[2].self_attn, "k_proj")
    assert [layer.self_attn.head_dim for layer in layers] == [16, 32, 16, 32]
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        model.model.embed_tokens_per_layer.weight.normal_(0.0, 1.0)
    assert abs(model(input_ids=ids, labels=ids).loss.item() / loss.item() - 1) > 100 * EXACT


@pytest.fixture(scope="module")
def sp_results():
    return sp_runs_by_world(WORLD2, WORLD4)


@pytest.mark.dist
@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=lambda c: c.name)
def test_sp_matches_single_process(case, sp_results):
    check_sp_case(case, sp_results, EXACT)
