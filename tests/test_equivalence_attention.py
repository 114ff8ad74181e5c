"""Attention sinks (gpt-oss) and MLA (DeepSeek-V3, GLM-4.7-Flash: value head dim != q/k head dim) under SP: SPTrainer
on 2 and 4 gloo processes trains exactly like plain Trainer in one process (Ulysses, ring, hybrid)."""

import pytest
import torch

from hf_sp_trainer.attention.gathered_keys import GATHER_ABOVE_ENV as GATHER
from hf_sp_trainer.validate import validate_model_for_sp
from tests.exactness import assert_exact
from tests.harness import EXACT, Case, check_sp_case, run_distributed, sp_runs_by_world, tiny_model, unwrap_results

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

RING2 = {"sp_ring_size": 2}
SGD = dict(optim="sgd", steps=4)  # weights after SGD steps: Adam would turn fp32 noise into ±lr steps
# gpt-oss builds its masks without position_ids, so the single-process reference attends across packed documents:
# one sequence per batch there (packed documents with sinks: tests/test_ring_attention.py).
GPT_OSS = dict(family="gpt_oss", attn="eager", batch_size=1, eval_batch_size=1, steps=4)
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.5)
WORLD2 = [
    Case("gpt_oss_sinks", **GPT_OSS),  # ulysses 2: the model's eager with this rank's slice of the sinks
    Case("ring2_gpt_oss_sinks", **GPT_OSS, sp_overrides=RING2),  # the ring op's sinks
    Case("fsdp2_gpt_oss_sinks", **GPT_OSS, backend="fsdp2"),  # sinks sliced from the unsharded parameter
    Case("zero3_ring2_gpt_oss_sinks", **GPT_OSS, backend="zero3", sp_overrides=RING2),
    Case("ring2_gpt_oss_sinks_router_loss", **GPT_OSS, model_overrides=ROUTER_LOSS, sp_overrides=RING2),  # + MoE aux
    Case("deepseek_v3_mla", family="deepseek_v3"),  # CPU sdpa block kernel, V zero-padded to the q/k head dim
    Case("ring2_deepseek_v3_mla", family="deepseek_v3", sp_overrides=RING2),
    Case("glm4_moe_lite_mla", family="glm4_moe_lite", attn="eager"),
    Case("ring2_glm4_moe_lite_mla", family="glm4_moe_lite", sp_overrides=RING2),
    Case("deepseek_v32_dsa_sgd_ga2", family="deepseek_v32", grad_accum=2, **SGD),  # the indexer's top-k over ranks
    Case("glm_moe_dsa_shared_topk", family="glm_moe_dsa", **SGD),  # its second layer reuses the first's top-k
    # activation checkpointing: transformers leaves DDP's find_unused_parameters off, and the indexer gets no gradient
    # (no_grad): SPTrainer tells DDP (trainers.base.tell_ddp_of_no_grad_indexers), else step 2 stops
    Case("deepseek_v32_dsa_grad_ckpt", family="deepseek_v32", sp_overrides=dict(gradient_checkpointing=True), **SGD),
    # HY-V4: DSA with learned sinks and hyper-connections, its second layer reusing the first's top-k (eager only)
    Case("hy_v4_dsa_sinks_sgd_ga2", family="hy_v4", attn="eager", grad_accum=2, **SGD),
    # Doge: each query's top-6 keys of its document by a learned bias (A and dt_proj train), a window of 12. Its
    # first layer's bias is a function of the token alone: a token repeated in a window ties exactly, and torch.topk
    # breaks the tie by the row's layout (one device's packed and padded rows differ too), so no token twice
    Case("doge_dynamic_mask_sgd_ga2", family="doge", grad_accum=2, distinct_tokens=True, **SGD),
    Case("ring2_doge_dynamic_mask", family="doge", distinct_tokens=True, sp_overrides=RING2, **SGD),
    # DSA with a ring (sp 2 = ring 2): the all-gather path, the ring group's K/V gathered (attention/dsa.ring_gather)
    Case("ring2_deepseek_v32_dsa_ga2", family="deepseek_v32", grad_accum=2, sp_overrides=RING2, **SGD),
    # DSA's gathered (sparse) kernel, which the tiny rows are far too short to take by themselves (GATHER_ABOVE)
    Case("ring2_deepseek_v32_dsa_gathered", family="deepseek_v32", sp_overrides=RING2, env={GATHER: "0"}, **SGD),
    # DeepSpeed hands the optimizer zero gradients for the parameters that get none (DSA's indexer: no_grad in
    # transformers), so weight decay shrinks them; torch's optimizer skips them. Without weight decay both agree.
    Case(
        "zero3_deepseek_v32_dsa", family="deepseek_v32", backend="zero3", train_overrides=dict(weight_decay=0.0), **SGD
    ),
    # MiniMax-M3: top-2 blocks of 4 keys per KV group (attention/block_sparse.py), with its MoE router loss
    Case("minimax_m3_block_sparse_ga2", family="minimax_m3", grad_accum=2, model_overrides=ROUTER_LOSS, **SGD),
    # DeepSeek-V4: window + compressed entries (attention/deepseek_v4.py), hash- and learned-routed MoE, mHC
    Case("deepseek_v4_sgd_ga2", family="deepseek_v4", attn="eager", grad_accum=2, **SGD),
    Case("deepseek_v4_router_loss", family="deepseek_v4", attn="eager", model_overrides=ROUTER_LOSS, **SGD),
    Case(  # its indexer gets no gradient: no weight decay, as for DSA under ZeRO
        "zero3_deepseek_v4",
        family="deepseek_v4",
        attn="eager",
        backend="zero3",
        train_overrides=dict(weight_decay=0.0),
        **SGD,
    ),  # fmt: skip
]
WORLD4 = [
    Case("sp4_gpt_oss_sinks_kv_rep", **GPT_OSS, sp_size=4, world_size=4),  # 2 kv heads over 4 ranks
    Case("hybrid2x2_gpt_oss_sinks", **GPT_OSS, sp_size=4, world_size=4, sp_overrides=RING2),
    Case("sp4_deepseek_v3_mla", family="deepseek_v3", sp_size=4, world_size=4),
    Case("sp4_deepseek_v32_dsa", family="deepseek_v32", sp_size=4, world_size=4, **SGD),
    Case("sp4_hy_v4_dsa_sinks", family="hy_v4", attn="eager", sp_size=4, world_size=4, **SGD),  # one head per rank
    Case("sp4_doge_dynamic_mask", family="doge", sp_size=4, world_size=4, distinct_tokens=True, **SGD),  # 2 kv heads
    Case("hybrid2x2_doge", family="doge", sp_size=4, world_size=4, distinct_tokens=True, sp_overrides=RING2, **SGD),
    Case("hybrid2x2_hy_v4_dsa_sinks", family="hy_v4", attn="eager", sp_size=4, world_size=4, sp_overrides=RING2, **SGD),
    Case("dp2sp2_glm_moe_dsa", family="glm_moe_dsa", sp_size=2, world_size=4, grad_accum=2, **SGD),
    Case("sp4_minimax_m3_block_sparse", family="minimax_m3", sp_size=4, world_size=4, **SGD),  # 2 kv heads, 4 ranks
    Case(  # Ulysses 2 x ring 2: the selections over the zigzag shards, the ring group's K/V gathered
        "hybrid2x2_minimax_m3_router_loss",
        family="minimax_m3",
        sp_size=4,
        world_size=4,
        sp_overrides=RING2,
        model_overrides=ROUTER_LOSS,
        **SGD,
    ),  # fmt: skip
    Case("sp4_deepseek_v4", family="deepseek_v4", attn="eager", sp_size=4, world_size=4, **SGD),
    Case(  # 6 heads over 4 ranks: its attention splits no heads (contiguous shards, all heads of a rank's queries)
        "sp4_deepseek_v4_6_heads",
        family="deepseek_v4",
        attn="eager",
        sp_size=4,
        world_size=4,
        model_overrides=dict(num_attention_heads=6),
        **SGD,
    ),  # fmt: skip
    Case("dp2sp2_deepseek_v4", family="deepseek_v4", attn="eager", sp_size=2, world_size=4, grad_accum=2, **SGD),
]


# -- in-process ----------------------------------------------------------------------------------------------------
def test_tiny_models_have_the_features_under_test():
    """Negative control: the tiny gpt-oss's large sinks change its loss far beyond the tolerance (a dropped or
    misplaced sink fails the cases below); the MLA models have q/k head dim != v head dim and a non-default scale."""

    def loss_and_grads(sinks: bool) -> tuple[float, torch.Tensor]:
        model = tiny_model("gpt_oss", attn="eager")
        if not sinks:
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.fill_(-1e9)
        ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "sinks" not in n])

    (loss, grads), (loss0, grads0) = loss_and_grads(True), loss_and_grads(False)
    assert abs(loss0 / loss - 1) > 10 * EXACT and abs(float(grads0.norm() / grads.norm()) - 1) > 100 * EXACT
    assert float((grads0 - grads).norm() / grads.norm()) > 0.1
    model = tiny_model("gpt_oss", attn="eager")
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    for family in ("deepseek_v3", "glm4_moe_lite"):
        attn = tiny_model(family).model.layers[0].self_attn
        assert (attn.qk_head_dim, attn.v_head_dim) == (24, 16)
    assert tiny_model("deepseek_v3").model.layers[0].self_attn.scaling != 24**-0.5  # yarn mscale


def test_unsupported_sink_forms_are_refused():
    model = tiny_model("gpt_oss", attn="eager")
    assert validate_model_for_sp(model, 2) == (2, 1)  # per-head sinks: supported
    attn = model.model.layers[1].self_attn
    attn.sinks = torch.nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="one sink logit per query head"):
        validate_model_for_sp(model, 2)
    del attn.sinks
    attn.sink_proj = torch.nn.Linear(64, 4)  # per-token sinks computed from the hidden states (inkling2's form)
    with pytest.raises(ValueError, match="per-token attention sinks"):
        validate_model_for_sp(model, 2)


# -- distributed ---------------------------------------------------------------------------------------------------
WINDOW = dict(sliding_window=12, layer_types=["sliding_attention", "full_attention"])
SINK_FAMILIES = {  # other per-head sink models (forward): granite's sigmoid(lse - sink) form is the same extra logit
    "granite_swa": ("GraniteSWAConfig", dict(head_dim=16, **WINDOW)),
    "granitemoe_swa": ("GraniteMoeSWAConfig", dict(num_local_experts=4, num_experts_per_tok=2, **WINDOW)),
    "flint": ("FlintConfig", dict(head_dim=16, sliding_window=12)),
    "mimo_v2_flash": (  # sinks on the sliding layers only, which have twice the kv heads; v head dim != q/k's
        "MiMoV2FlashConfig",
        dict(
            head_dim=24,
            v_head_dim=16,
            sliding_window=12,
            layer_types=["full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse"],
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
    ),  # fmt: skip
}


def _sink_model(config_name: str, overrides: dict, sinks: bool = True):
    import transformers

    from tests.harness import init_large_sinks

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**base, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    init_large_sinks(model)
    with torch.no_grad():
        for m in model.modules():
            if not sinks and getattr(m, "sinks", None) is not None:
                m.sinks.fill_(-1e9)
    return model


def _sink_family_forwards() -> dict[str, float]:
    """Max relative |SP logits - single-process logits| at sp 2 (Ulysses, ring), and the no-sink control."""
    import torch.distributed as dist

    from hf_sp_trainer import apply_sequence_parallel
    from tests.test_attention import _sp_logits

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    rows = {"input_ids": torch.randint(3, 128, (2, 24)), "position_ids": torch.arange(24).expand(2, -1)}
    out = {}
    for name, (config_name, overrides) in SINK_FAMILIES.items():
        with torch.no_grad():
            ref = _sink_model(config_name, overrides)(**rows).logits
            no_sinks = _sink_model(config_name, overrides, sinks=False)(**rows).logits
        out[f"{name}_control"] = float((no_sinks - ref).abs().max() / ref.abs().max())
        for ring in (1, 2):
            sp = apply_sequence_parallel(
                _sink_model(config_name, overrides), 2, ring_size=ring, attn_implementation="eager"
            )
            out[f"{name}_ring{ring}"] = float((_sp_logits(sp, rows) - ref).abs().max() / ref.abs().max())
            sp.remove()
    return out


@pytest.mark.dist
def test_other_sink_families_forward_match_single_process():
    for result in unwrap_results(run_distributed(2, _sink_family_forwards, timeout=600)):
        for name in SINK_FAMILIES:
            assert result[f"{name}_control"] > 1e-2, result  # the sinks matter
            assert_exact(f"{name} sinks forward", {f"ring {r}": result[f"{name}_ring{r}"] for r in (1, 2)})


@pytest.fixture(scope="module")
def sp_results():
    return sp_runs_by_world(WORLD2, WORLD4)


@pytest.mark.dist
@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=lambda c: c.name)
def test_sp_matches_single_process(case, sp_results):
    check_sp_case(case, sp_results, EXACT)
