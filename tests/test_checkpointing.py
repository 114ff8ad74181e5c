"""Sequence-aware selective checkpointing and checkpoint offload.

- ``sequence_aware`` does not recompute what full checkpointing recomputes at O(s^2) cost (the attention kernels)
  and does recompute the Ulysses all-to-alls: counted at the dispatcher during backward, with identical gradients;
- the offload hooks move exactly the checkpointed hidden states and leave gradients bit-identical (run on CPU with
  host copies; on CPU the feature itself is a warned no-op);
- training with either feature (and both, with SP=2, eager attention, LoRA via SPSFTTrainer) equals plain
  single-process training within 1e-5; misuse raises ``ValueError``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_sp_trainer.memory.checkpointing import (
    KEEP_BUDGET_MARK,
    MemoryCheckpoint,
    checkpointed_modules,
    wrap_checkpointed_layers,
)
from hf_sp_trainer.memory.offload import HostOffload
from tests.harness import (
    CHECKPOINTING_ARG,
    Case,
    assert_case,
    compare,
    enable_checkpointing,
    run_cases,
    run_distributed,
    synthetic_dataset,
    tiny_model,
    unwrap_results,
)
from tests.sft_harness import SFTCase, reference_run

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

GC = {"gradient_checkpointing": True}
SAC = {"checkpoint_policy": "sequence_aware"}
OFFLOAD = {"checkpoint_offloading": True}
AUTO = {"checkpoint_policy": "auto", "checkpoint_memory_budget": 1e15}  # from the second step every layer keeps
CASES = [
    Case("sac_llama_sp2", train_overrides=GC, sp_overrides=SAC),
    Case("auto_llama_sp2_ga2", grad_accum=2, train_overrides=GC, sp_overrides=AUTO),
    Case("auto_ring2", train_overrides=GC, sp_overrides=AUTO | {"sp_ring_size": 2}),  # the ring op kept by both ranks
    Case(
        "sac_offload_mistral_eager_sp2", family="mistral", attn="eager", train_overrides=GC, sp_overrides=SAC | OFFLOAD
    ),
    Case("offload_qwen3_sp2", family="qwen3", optim="sgd", train_overrides=GC, sp_overrides=OFFLOAD),
]
SFT_CASES = [SFTCase("sft_lora_sac_offload_sp2", lora=True, config=SAC | OFFLOAD)]  # TRL checkpoints by default
ATTENTION_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"
ALL_TO_ALL_OP = "hf_sp_trainer.all_to_all.default"
PACKED_OP = "hf_sp_trainer.all_to_all_packed.default"  # q, k and v in one exchange
SP_ATTENTION_OP = "hf_sp_trainer.ring_attention.default"  # the block kernels, one op per layer (CPU sdpa)


class OpCounter(TorchDispatchMode):
    """Counts every op that actually executes (SAC's cache answers saved ops before they reach this mode)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _forward_backward(model, inputs) -> tuple[Counter, Counter, dict[str, torch.Tensor]]:
    with OpCounter() as forward:
        loss = model(**inputs).loss
    with OpCounter() as backward:
        loss.backward()
    return forward.counts, backward.counts, {n: p.grad.clone() for n, p in model.named_parameters()}


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-30)) for n in b)


# ----------------------------------------------------------------------------------------------------------------
# one process
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "attn, recomputed_kernel_ops", [("sdpa", (ATTENTION_OP,)), ("eager", ("aten._softmax.default",))]
)
def test_sequence_aware_skips_attention_recompute(attn, recomputed_kernel_ops):
    base = tiny_model("llama", attn=attn).train()
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids, "position_ids": torch.cat([torch.arange(12), torch.arange(18)])[None]}
    runs = {}
    for policy in ("off", "full", "sequence_aware"):
        model = copy.deepcopy(base)
        if policy != "off":
            enable_checkpointing(model)
        if policy == "sequence_aware":
            from hf_sp_trainer.memory.checkpointing import sequence_aware_context_fn

            assert wrap_checkpointed_layers(model, sequence_aware_context_fn) == 2
        runs[policy] = _forward_backward(model, inputs)
    for op in recomputed_kernel_ops:
        calls = runs["off"][0][op]
        assert calls > 0
        assert [runs[p][1][op] for p in ("off", "full", "sequence_aware")] == [0, calls, 0]
    for policy in ("full", "sequence_aware"):
        assert _max_rel(runs[policy][2], runs["off"][2]) == 0.0


@pytest.mark.parametrize("family", ["qwen3_5", "minimax"])
def test_sequence_aware_recomputes_the_hybrid_mixers(family):
    """Inside the SP hybrid mixers (``recompute_region``) every op is recomputed: Gated DeltaNet's and lightning
    attention's chunk matmuls (``bmm``, O(s)) run again in the backward as under full checkpointing, while the
    attention layer's kernel is still saved; gradients equal the unchecked ones."""
    from hf_sp_trainer.memory.checkpointing import sequence_aware_context_fn
    from hf_sp_trainer.mixers.documents import keep_documents_apart

    base = tiny_model(family).train()
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids, "position_ids": torch.cat([torch.arange(12), torch.arange(18)])[None]}
    runs = {}
    for policy in ("off", "full", "sequence_aware"):
        model = copy.deepcopy(base)
        assert keep_documents_apart(model) is not None
        if policy != "off":
            enable_checkpointing(model)
        if policy == "sequence_aware":
            wrap_checkpointed_layers(model, sequence_aware_context_fn)
        runs[policy] = _forward_backward(model, inputs)
    bmm = "aten.bmm.default"
    assert runs["off"][0][bmm] > 0 and runs["off"][1][ATTENTION_OP] == 0
    assert runs["sequence_aware"][1][bmm] == runs["full"][1][bmm] > runs["off"][1][bmm]
    assert runs["full"][1][ATTENTION_OP] > 0 and runs["sequence_aware"][1][ATTENTION_OP] == 0
    for policy in ("full", "sequence_aware"):
        assert _max_rel(runs[policy][2], runs["off"][2]) == 0.0


def _checkpointed_pair(family: str, shape: tuple[int, int], seed: int):
    """Two copies of a tiny ``family`` model with activation checkpointing on (a reference and one to modify), and
    random ``shape`` inputs labelled with themselves."""
    base = tiny_model(family).train()
    ids = torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    for m in (ref, model):
        enable_checkpointing(m)
    return ref, model, {"input_ids": ids, "labels": ids}


def test_offload_hooks_move_the_checkpointed_hidden_states():
    """The CUDA path's hooks with host copies on CPU: one hidden state per layer leaves and comes back exactly."""
    ref, model, inputs = _checkpointed_pair("qwen3", (2, 24), seed=1)
    hooks = HostOffload(device_type="cpu", min_bytes=0)
    for layer in checkpointed_modules(model):
        layer._gradient_checkpointing_func = MemoryCheckpoint(layer._gradient_checkpointing_func, None, hooks)
    *_, ref_grads = _forward_backward(ref, inputs)
    *_, grads = _forward_backward(model, inputs)
    assert hooks.packed == 2  # the input hidden states of the 2 checkpointed decoder layers
    assert _max_rel(grads, ref_grads) == 0.0


def test_selective_policy_with_offload_says_where_kept_tensors_go():
    """The selective policy and the offload hooks together: what the policy keeps stays outside the hooks, said
    explicitly to torch >= 2.14 (``respect_saved_tensors_hooks=False``; otherwise it warns that a later release
    routes them through the hooks); gradients as plain checkpointing's. (On torch 2.13 there is nothing to say.)"""
    import inspect
    import warnings

    from hf_sp_trainer.memory.checkpointing import sequence_aware_context_fn

    ref, model, inputs = _checkpointed_pair("llama", (1, 32), seed=2)
    hooks = HostOffload(device_type="cpu", min_bytes=0)
    seen = []
    for layer in checkpointed_modules(model):
        inner = layer._gradient_checkpointing_func

        def recording(*args, _inner=inner, **kwargs):
            seen.append(kwargs.get("respect_saved_tensors_hooks"))
            return _inner(*args, **kwargs)

        recording.__signature__ = inspect.signature(inner)
        layer._gradient_checkpointing_func = MemoryCheckpoint(recording, sequence_aware_context_fn, hooks)
    *_, ref_grads = _forward_backward(ref, inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        *_, grads = _forward_backward(model, inputs)
    assert not [w for w in caught if "saved_tensors_hooks" in str(w.message)]
    takes = "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    assert seen and set(seen) == {False if takes else None}, seen
    assert _max_rel(grads, ref_grads) < 1e-6


def _sp_trainer(tmp_path, **args):
    from transformers import DataCollatorWithFlattening

    from hf_sp_trainer import SPTrainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **args)
    collator = DataCollatorWithFlattening(return_position_ids=True)
    return SPTrainer(model=tiny_model("llama"), args=args, train_dataset=synthetic_dataset(2), data_collator=collator)


@pytest.mark.parametrize(
    "args, match",
    [
        (SAC, "activation checkpointing, which is off"),
        (OFFLOAD, "activation checkpointing, which is off"),
        (GC | SAC | {"gradient_checkpointing_kwargs": {"use_reentrant": True}}, "non-reentrant"),
        (GC | {"checkpoint_policy": "selective"}, "checkpoint_policy='selective' is not one of"),
    ],
)
def test_misuse_raises(tmp_path, args, match):
    with pytest.raises(ValueError, match=match):
        _sp_trainer(tmp_path, **args)


def test_offload_on_cpu_is_a_warned_no_op(tmp_path, caplog):
    from transformers.utils.logging import warning_once

    warning_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_sp_trainer.memory.checkpointing"):
        trainer = _sp_trainer(tmp_path, max_steps=1, per_device_train_batch_size=2, **GC, **OFFLOAD)
    assert "checkpoint_offloading=True has no effect on CPU" in caplog.text
    trainer.train()
    layers = checkpointed_modules(trainer.model)
    assert layers and not any(isinstance(m._gradient_checkpointing_func, MemoryCheckpoint) for m in layers)


@pytest.mark.parametrize("flag", ["checkpoint_offloading", "activation_offloading"])
def test_sp_sft_trainer_routes_activation_offloading_to_ours(tmp_path, caplog, flag):
    """TRL's own offloader needs an accelerator (on CPU it fails in SFTTrainer.__init__): SPSFTTrainer uses ours.
    ``activation_offloading`` (our flag's former name, also TRL's) still means ours, with a FutureWarning naming the
    new one; TRL never sees it on."""
    from transformers.utils.logging import warning_once

    from hf_sp_trainer import SFTConfig, SPSFTTrainer
    from hf_sp_trainer.data import build_char_tokenizer
    from tests.sft_harness import sft_dataset

    warning_once.cache_clear()
    config = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, max_length=None,
                  dataset_num_proc=None, **{flag: True})  # fmt: skip
    if flag == "activation_offloading":
        with pytest.warns(FutureWarning, match="set checkpoint_offloading instead"):
            args = SFTConfig(**config)
    else:
        args = SFTConfig(**config)
    with caplog.at_level(logging.WARNING, logger="hf_sp_trainer.memory.checkpointing"):
        trainer = SPSFTTrainer(
            model=tiny_model("llama"),
            args=args,
            train_dataset=sft_dataset("text", 4, 0),
            processing_class=build_char_tokenizer(),
        )
    assert getattr(args, CHECKPOINTING_ARG) and args.checkpoint_offloading  # TRL checkpoints by default
    assert not args.activation_offloading  # TRL's flag: off, whichever name was used
    assert isinstance(trainer.maybe_activation_offload_context, contextlib.nullcontext)
    assert "checkpoint_offloading=True has no effect on CPU" in caplog.text


def test_trl_config_activation_offloading_set_later_still_means_ours():
    """A flag set after the config was built (no post-init) is routed when the trainer is built, as before."""
    from hf_sp_trainer.memory import resolve_deprecated_flags
    from hf_sp_trainer.trainers.arguments import TrainingArguments

    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    args.activation_offloading = True
    with pytest.warns(FutureWarning, match="activation_offloading=True .* means checkpoint_offloading=True"):
        resolve_deprecated_flags(args)
    assert args.checkpoint_offloading and not args.activation_offloading


# ----------------------------------------------------------------------------------------------------------------
# SP=2: recomputation counted, and training equivalence
# ----------------------------------------------------------------------------------------------------------------
def _recompute_counts(policy: str, out_dir: str) -> dict:
    """One micro-step by hand, its ops counted. ``auto``: after two warm-up steps at learning rate 0 (the weights
    unchanged), with a budget every layer's attention outputs and all-to-all results fit in."""
    from hf_sp_trainer import SPTrainer, TrainingArguments

    model = tiny_model("llama")
    auto = AUTO | {"max_steps": 2, "learning_rate": 0.0, "logging_steps": 1} if policy == "auto" else {}
    args = TrainingArguments(
        output_dir=out_dir, sp_size=2, ddp_backend="gloo", use_cpu=True, report_to="none",
        per_device_train_batch_size=3, **({"checkpoint_policy": policy} | auto), **GC,
    )  # fmt: skip
    trainer = SPTrainer(model=model, args=args, train_dataset=synthetic_dataset(3, seed=1))
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    if auto:
        trainer.train()
    enable_checkpointing(model)  # as Trainer.train does first
    forward, backward, grads = _forward_backward(model.train(), inputs)
    keys = (SP_ATTENTION_OP, ALL_TO_ALL_OP, PACKED_OP)
    keep = getattr(model, KEEP_BUDGET_MARK, None)
    kept = {"layers": keep.kept_layers[-1], "exchanges": keep.kept_exchanges[-1]} if keep is not None else None
    counts = {"forward": {k: forward[k] for k in keys}, "backward": {k: backward[k] for k in keys}}
    return counts | {"grads": grads, "kept": kept}


def _run_all(cases: list) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        counts = {p: _recompute_counts(p, os.path.join(tmp, p)) for p in ("full", "sequence_aware", "auto")}
    return {"counts": counts, "runs": run_cases(cases)}


@pytest.fixture(scope="module")
def sp_results():
    return unwrap_results(run_distributed(2, _run_all, CASES + SFT_CASES))


@pytest.mark.dist
def test_sequence_aware_recomputes_no_attention_but_the_all_to_all_sp2(sp_results):
    """The attention kernel's output is kept (its recompute is O(s^2)); the all-to-all results are not (kept, the
    saved bytes per rank would grow with sp): the backward replays the forward's exchanges, as full checkpointing."""
    for rank in sp_results:
        print({p: {k: v for k, v in c.items() if k != "grads"} for p, c in rank["counts"].items()})
        full, selective = rank["counts"]["full"], rank["counts"]["sequence_aware"]
        kernels = full["forward"][SP_ATTENTION_OP]
        assert kernels == 2 and full["forward"][PACKED_OP] == 2 and full["forward"][ALL_TO_ALL_OP] == 2
        exchanges = 2 * 2  # per layer one attention op, one exchange of q, k and v, one of the output
        assert full["forward"] == selective["forward"]
        assert full["backward"][SP_ATTENTION_OP] == kernels and selective["backward"][SP_ATTENTION_OP] == 0
        # backward: the gradients' exchanges (the inverse all-to-all), plus the replayed forward ones
        for counts, expected in ((full, 2 * exchanges), (selective, 2 * exchanges)):
            assert counts["backward"][ALL_TO_ALL_OP] + counts["backward"][PACKED_OP] == expected, counts["backward"]
        assert _max_rel(selective["grads"], full["grads"]) == 0.0


@pytest.mark.dist
def test_auto_keeps_the_all_to_all_results_where_the_budget_allows_sp2(sp_results):
    """``auto`` with room for its second level: no kernel and no forward exchange is replayed in the backward (only
    the gradients' exchanges run), and the gradients are those of full checkpointing, bit for bit."""
    for rank in sp_results:
        full, auto = rank["counts"]["full"], rank["counts"]["auto"]
        assert auto["kept"] == {"layers": 2, "exchanges": 2}, auto["kept"]
        assert full["forward"] == auto["forward"] and auto["backward"][SP_ATTENTION_OP] == 0
        assert auto["backward"][ALL_TO_ALL_OP] + auto["backward"][PACKED_OP] == 2 * 2, auto["backward"]
        assert _max_rel(auto["grads"], full["grads"]) == 0.0


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES + SFT_CASES, ids=lambda c: c.name)
def test_checkpoint_features_train_like_plain_single_process(case, sp_results, tmp_path):
    got = sp_results[0]["runs"][case.name]
    ref = reference_run(case, str(tmp_path))
    diffs = compare(ref, got)
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert got["global_step"] == case.steps
    assert_case(case, diffs, ref)
