"""Hybrid models (Qwen3.5's Gated DeltaNet, LFM2's short convolutions, Granite-4.0-H's Mamba2, MiniMax's lightning
attention) under SP: SPTrainer on 2 and 4 gloo processes trains exactly like plain Trainer in one process, whose rows
are one document each (transformers' own forward leaks these layers' state across packed documents; SP keeps every
document apart, at every sp_size)."""

import importlib.util

import pytest
import torch

from tests.exactness import assert_exact
from tests.harness import EXACT, PURE_SSM, Case, check_sp_case, sp_runs_by_world, tiny_model
from tests.sft_harness import SFTCase
from tests.upstream import BEFORE_CACHE_ARGUMENT, CACHE_ARGUMENT

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

RING2 = {"sp_ring_size": 2}
RELAY = {"sp_state_passing": "relay"}  # the state handed rank to rank (a debugging aid), not gathered
SGD = dict(optim="sgd", steps=4)
CHECKPOINTING = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
NO_AUX = dict(output_router_logits=False)
# reentrant: a recompute without SP's scope would run the plain scan silently (non-reentrant would raise)
REENTRANT = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
MEMORY = dict(fused_loss=True, checkpoint_offloading=True, checkpoint_policy="sequence_aware", **CHECKPOINTING)
WORLD2 = [
    Case("qwen3_5_gdn_sgd_ga2", family="qwen3_5", grad_accum=2, **SGD),  # conv halo + state across the 2 ranks
    Case("qwen3_5_gdn_adamw", family="qwen3_5"),
    Case("ring2_qwen3_5_gdn", family="qwen3_5", sp_overrides=RING2, **SGD),  # 2 zigzag runs per rank
    Case("qwen3_5_gdn_memory_stack", family="qwen3_5", sp_overrides=MEMORY, **SGD),
    Case("zero3_qwen3_5_gdn", family="qwen3_5", backend="zero3", **SGD),
    Case("lfm2_short_conv_sgd_ga2", family="lfm2", grad_accum=2, **SGD),
    Case("ring2_lfm2_short_conv", family="lfm2", sp_overrides=RING2, **SGD),
    SFTCase(
        "sft_qwen3_5_gdn", family="qwen3_5", data="prompt_completion", config=dict(optim="sgd", learning_rate=0.05)
    ),
    SFTCase("sft_lora_lfm2", family="lfm2", lora=True),
    Case("granite4h_mamba2_sgd_ga2", family="granitemoehybrid", grad_accum=2, **SGD),  # Mamba2 + attention + MoE
    Case("relay_qwen3_5_gdn", family="qwen3_5", sp_overrides=RELAY, **SGD),
    Case("relay_granite4h_mamba2", family="granitemoehybrid", sp_overrides=RELAY, **SGD),
    Case("minimax_lightning_sgd_ga2", family="minimax", grad_accum=2, **SGD),  # lightning attention + MoE
    Case("ring2_minimax_lightning", family="minimax", sp_overrides=RING2, **SGD),
    Case("mamba2_pure_sgd_ga2", family="mamba2", attn="eager", grad_accum=2, **SGD),  # no attention: sequence only
    Case("ring2_mamba2_pure", family="mamba2", attn="eager", sp_overrides=RING2, **SGD),  # zigzag shards
    Case("jamba_mamba1_sgd_ga2", family="jamba", grad_accum=2, **SGD),  # Mamba1 + attention + MoE router loss
    # the recompute runs under its forward's SP scope; the router loss off: transformers' reentrant checkpoint runs
    # the forward under no_grad, so the router loss gets no gradient there even in one process
    Case("jamba_mamba1_grad_ckpt", family="jamba", sp_overrides=REENTRANT, model_overrides=NO_AUX, **SGD),
    Case("zero3_jamba_mamba1", family="jamba", backend="zero3", **SGD),
    Case("mamba1_pure_sgd_ga2", family="mamba", attn="eager", grad_accum=2, **SGD),  # no kwargs reach its layers
    Case("recurrent_gemma_rg_lru_sgd_ga2", family="recurrent_gemma", grad_accum=2, **SGD),  # RG-LRU + local attention
    Case("ring2_recurrent_gemma_rg_lru", family="recurrent_gemma", sp_overrides=RING2, **SGD),
    # Qwen4-Exp: Gated DeltaNet and query-sparse attention (the whole sequence's top-2 blocks of 4), MoE router loss
    Case("qwen4_exp_qsa_sgd_ga2", family="qwen4_exp", grad_accum=2, **SGD),
    # the selection recomputed in the backward; its indexer gets no gradient (as on one device), which SPTrainer tells
    # DDP of once checkpointing is on (transformers then leaves find_unused_parameters off)
    Case("qwen4_exp_qsa_grad_ckpt", family="qwen4_exp", sp_overrides=CHECKPOINTING, **SGD),
    # kernelized as from_pretrained loads it by default from transformers 5.25 (`kernels` installed: no CPU hub
    # kernel for these layers, so kernelize keeps them; SP swaps their layer functions and kernels as without)
    *[
        Case(f"{family}_hub_kernels", family=family, hub_kernels=True, **SGD)
        for family in ("qwen3_5", "granitemoehybrid", "jamba")
        if importlib.util.find_spec("kernels") is not None
    ],
]
WORLD4 = [
    Case("sp4_qwen3_5_gdn", family="qwen3_5", sp_size=4, world_size=4, **SGD),  # a document over >= 3 ranks
    Case("hybrid2x2_qwen3_5_gdn", family="qwen3_5", sp_size=4, world_size=4, sp_overrides=RING2, **SGD),
    Case("dp2sp2_lfm2_short_conv", family="lfm2", sp_size=2, world_size=4, **SGD),
    Case("sp4_minimax_lightning", family="minimax", sp_size=4, world_size=4, **SGD),
    Case("sp4_mamba2_pure", family="mamba2", attn="eager", sp_size=4, world_size=4, **SGD),
    Case("sp4_jamba_mamba1", family="jamba", sp_size=4, world_size=4, **SGD),
    Case("sp4_recurrent_gemma_rg_lru", family="recurrent_gemma", sp_size=4, world_size=4, **SGD),
    Case("sp4_qwen4_exp_qsa", family="qwen4_exp", sp_size=4, world_size=4, **SGD),
    Case("hybrid2x2_qwen4_exp_qsa", family="qwen4_exp", sp_size=4, world_size=4, sp_overrides=RING2, **SGD),
    # the router loss off: a whole-batch product of averages, it differs per DP group with or without SP
    Case("dp2sp2_jamba_mamba1", family="jamba", sp_size=2, world_size=4, grad_accum=2, model_overrides=NO_AUX, **SGD),
    Case("relay_hybrid2x2_qwen3_5_gdn", family="qwen3_5", sp_size=4, world_size=4, sp_overrides=RING2 | RELAY, **SGD),
]

if not CACHE_ARGUMENT:  # Qwen4-Exp's QSA and PLE layers take `cache` from transformers 5.24: refused before it
    WORLD2, WORLD4 = ([c for c in cases if c.family != "qwen4_exp"] for cases in (WORLD2, WORLD4))


@torch.no_grad()
def test_reference_keeps_documents_apart_and_packing_would_not():
    """Negative control for the reference: transformers' packed forward of a hybrid model differs from its forward
    of each document alone (the state leaks), while the padded rows the references train on do not."""
    for family in ("qwen3_5", "lfm2", "granitemoehybrid", "minimax", "jamba", "recurrent_gemma"):
        model = tiny_model(family).eval()
        g = torch.Generator().manual_seed(0)
        docs = [torch.randint(3, 128, (n,), generator=g) for n in (13, 9)]
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
        packed = model(
            input_ids=torch.cat(docs)[None], position_ids=torch.cat([torch.arange(13), torch.arange(9)])[None]
        )
        padded = model(
            input_ids=torch.stack([docs[0], torch.cat([docs[1], torch.zeros(4, dtype=torch.long)])]),
            attention_mask=torch.tensor([[1] * 13, [1] * 9 + [0] * 4]),
        ).logits
        rows = torch.cat([padded[0], padded[1, :9]])
        assert float((packed.logits[0] - alone).abs().max()) > 1e-4, family  # >> EXACT: a leak fails every case below
        assert float((rows - alone).abs().max()) < 1e-5, family


@pytest.fixture(scope="module")
def sp_results():
    return sp_runs_by_world(WORLD2, WORLD4)


@pytest.mark.dist
@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=lambda c: c.name)
def test_sp_matches_single_process(case, sp_results):
    check_sp_case(case, sp_results, EXACT)


def _sp1_run(family: str, collator, sp_trainer: bool, out_dir: str) -> dict:
    import transformers

    from hf_sp_trainer import SPTrainer, TrainingArguments
    from tests.harness import quiet_args, synthetic_dataset

    model = tiny_model(family, attn="eager" if family in {*PURE_SSM, "deepseek_v4"} else "sdpa")  # no attention / sinks
    common = quiet_args(out_dir, 3) | dict(
        per_device_train_batch_size=3, optim="sgd", learning_rate=5e-2, remove_unused_columns=False
    )
    train = synthetic_dataset(9, seed=1)
    if sp_trainer:
        trainer = SPTrainer(model=model, args=TrainingArguments(**common), train_dataset=train, data_collator=collator)
    else:
        args = transformers.TrainingArguments(**common)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"losses": losses, "params": torch.cat([p.detach().flatten() for p in model.parameters()])}


@pytest.mark.parametrize(
    "family",
    ["qwen3_5", "lfm2", "minimax", "mamba2", "jamba", "mamba", "recurrent_gemma", "deepseek_v4"]
    + (["qwen4_exp"] if CACHE_ARGUMENT else []),  # before transformers 5.24: refused (test_mixers_detect.py)
)
def test_sp_size_1_keeps_packed_documents_apart(family, tmp_path):
    """SPTrainer(sp_size=1) on position_ids-packed rows trains like plain Trainer on one document per row; plain
    Trainer on the same packed rows does not (transformers' hybrid layers leak across documents). Mamba2ForCausalLM
    doesn't pass its position_ids on to its backbone: the documents come from the model's own call."""
    from transformers import DataCollatorWithFlattening

    from tests.harness import pad_rows

    packed = DataCollatorWithFlattening(return_position_ids=True)
    ours = _sp1_run(family, packed, True, str(tmp_path / "ours"))
    ref = _sp1_run(family, pad_rows, False, str(tmp_path / "ref"))
    leaky = _sp1_run(family, packed, False, str(tmp_path / "leaky"))
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    losses = max(abs(a / b - 1) for a, b in zip(ours["losses"], ref["losses"], strict=True))
    assert_exact(f"{family} sp 1 packed", {"losses": losses, "params": rel(ours["params"], ref["params"])})
    assert rel(leaky["params"], ref["params"]) > 10 * rel(ours["params"], ref["params"])


@pytest.mark.skipif(not CACHE_ARGUMENT, reason=BEFORE_CACHE_ARGUMENT)
def test_minimax_m3_packed_rows_refused_at_sp_size_1(tmp_path):
    """MiniMax-M3's block selection at sp_size 1 is transformers' own, whose key blocks sit at row slots: a row packed
    from several documents is refused (it trained 0.4% off each document alone); one document per row runs."""
    from transformers import DataCollatorWithFlattening

    from tests.harness import pad_rows

    with pytest.raises(ValueError, match="sp_size >= 2"):
        _sp1_run("minimax_m3", DataCollatorWithFlattening(return_position_ids=True), True, str(tmp_path / "packed"))
    ours = _sp1_run("minimax_m3", pad_rows, True, str(tmp_path / "ours"))
    ref = _sp1_run("minimax_m3", pad_rows, False, str(tmp_path / "ref"))
    assert ours["losses"] == ref["losses"] and torch.equal(ours["params"], ref["params"])
