"""Bad input gives the same clear ValueError on every rank, before any collective that could hang."""

import pytest
import torch

from tests.harness import run_distributed, synthetic_dataset, tiny_model, unwrap_results

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not


def _args(tmp, sp_size=2, **kw):
    from hf_sp_trainer import TrainingArguments

    return TrainingArguments(
        output_dir=tmp,
        sp_size=sp_size,
        per_device_train_batch_size=2,
        max_steps=2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        **kw,
    )


def _padded_collator(features):
    """A classic right-padding collator: attention_mask has zeros."""
    length = max(len(f["input_ids"]) for f in features)
    ids = [f["input_ids"] + [0] * (length - len(f["input_ids"])) for f in features]
    mask = [[1] * len(f["input_ids"]) + [0] * (length - len(f["input_ids"])) for f in features]
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _rank_dependent_collator(features):
    """Breaks the SP contract: each rank of the group builds a different-length batch."""
    import torch.distributed as dist

    ids = [t for f in features for t in f["input_ids"]][: 8 + 2 * dist.get_rank()]
    ids = torch.tensor([ids])
    return {"input_ids": ids, "labels": ids.clone()}


def _cases(tmp):
    import torch.distributed as dist
    import transformers

    from hf_sp_trainer import SPTrainer, apply_sequence_parallel

    train = synthetic_dataset(8, seed=3)

    def sp_not_dividing_world():
        _args(tmp, sp_size=3)

    def impossible_split():  # 3 heads can't be split over 2 Ulysses ranks (sp_ring_size=1 forces Ulysses only)
        model = tiny_model("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
        SPTrainer(model=model, args=_args(tmp, sp_ring_size=1), train_dataset=train)

    def ring_kernel_without_lse():  # 3 heads on sp 2: a ring, and flex_attention returns no log-sum-exp
        model = tiny_model("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
        SPTrainer(model=model, args=_args(tmp, sp_attn_implementation="flex_attention"), train_dataset=train)

    def attention_outside_registry():
        config = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=1, n_head=4)
        SPTrainer(model=transformers.BloomForCausalLM(config), args=_args(tmp), train_dataset=train)

    def padded_attention_mask():
        trainer = SPTrainer(
            model=tiny_model("llama"), args=_args(tmp), train_dataset=train, data_collator=_padded_collator
        )
        trainer.train()

    def lengths_differ_in_group():
        trainer = SPTrainer(
            model=tiny_model("llama"), args=_args(tmp), train_dataset=train, data_collator=_rank_dependent_collator
        )
        trainer.train()

    def padding_on_one_rank_only():  # direct use of the backend, outside the Trainer
        model = tiny_model("llama")
        apply_sequence_parallel(model, 2)
        mask = torch.ones(1, 8, dtype=torch.long)
        if dist.get_rank() == 0:
            mask[0, -2:] = 0
        model(input_ids=torch.randint(3, 100, (1, 8)), attention_mask=mask)

    def shard_lengths_differ():
        model = tiny_model("llama")
        apply_sequence_parallel(model, 2)
        model(input_ids=torch.randint(3, 100, (1, 8 + 2 * dist.get_rank())))

    def logits_to_keep_under_sp():  # Gemma4's decoder would keep this rank's last tokens
        model = tiny_model("gemma4")
        apply_sequence_parallel(model, 2)
        model(input_ids=torch.randint(3, 100, (1, 8)), logits_to_keep=1)

    def grpo_server_weight_sync_outside_server_mode():
        from hf_sp_trainer import GRPOConfig

        GRPOConfig(
            output_dir=tmp, sp_size=2, use_vllm=True, vllm_server_weight_sync="files", use_cpu=True, report_to="none"
        )

    def grpo_unknown_server_weight_sync():
        from hf_sp_trainer import GRPOConfig

        GRPOConfig(
            output_dir=tmp,
            sp_size=2,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_weight_sync="ftp",
            use_cpu=True,
            report_to="none",
        )

    def grpo_vllm_tensor_parallel_not_over_the_group():
        from hf_sp_trainer import GRPOConfig

        GRPOConfig(
            output_dir=tmp, sp_size=2, use_vllm=True, vllm_tensor_parallel_size=2, use_cpu=True, report_to="none"
        )

    def grpo_with_rollout_func():
        from hf_sp_trainer import GRPOConfig, SPGRPOTrainer
        from hf_sp_trainer.data import build_char_tokenizer
        from tests.grpo_harness import reward_len_and_vowels, rl_dataset

        args = GRPOConfig(
            output_dir=tmp,
            sp_size=2,
            use_cpu=True,
            report_to="none",
            per_device_train_batch_size=2,
            num_generations=2,
            ddp_backend="gloo",
        )
        SPGRPOTrainer(
            model=tiny_model("llama"),
            reward_funcs=reward_len_and_vowels,
            args=args,
            train_dataset=rl_dataset(4, 0),
            processing_class=build_char_tokenizer(),
            rollout_func=lambda prompts, trainer: {},
        )

    return [
        sp_not_dividing_world,
        impossible_split,
        ring_kernel_without_lse,
        attention_outside_registry,
        padded_attention_mask,
        lengths_differ_in_group,
        padding_on_one_rank_only,
        shard_lengths_differ,
        logits_to_keep_under_sp,
        grpo_server_weight_sync_outside_server_mode,
        grpo_unknown_server_weight_sync,
        grpo_vllm_tensor_parallel_not_over_the_group,
        grpo_with_rollout_func,
    ]


def run_bad_inputs(tmp):
    """Each case in turn on every rank; the error each rank raised (or "no error")."""
    import torch.distributed as dist

    out = {}
    for case in _cases(tmp):
        try:
            case()
            out[case.__name__] = "no error"
        except ValueError as exc:
            out[case.__name__] = f"ValueError: {exc}"
        if dist.is_initialized():
            dist.barrier()  # the group is still usable: nobody is stuck in a collective
    return out


EXPECTED = {
    "sp_not_dividing_world": ["sp_size=3", "world size 2"],
    "impossible_split": ["Ulysses degree of 2", "3 query heads", "sp_ring_size"],
    "ring_kernel_without_lse": ["ulysses 1 x ring 2", "log-sum-exp", "'flex_attention'"],
    "attention_outside_registry": ["BloomForCausalLM", "AttentionInterface"],
    "padded_attention_mask": ["attention_mask", "padding zeros"],
    "lengths_differ_in_group": ["different shapes"],
    "padding_on_one_rank_only": ["attention_mask", "padding zeros"],
    "shard_lengths_differ": ["different shapes"],
    "logits_to_keep_under_sp": ["logits_to_keep=1", "without logits_to_keep"],
    "grpo_server_weight_sync_outside_server_mode": ["vllm_server_weight_sync", "vllm_mode='server'", "'colocate'"],
    "grpo_unknown_server_weight_sync": ["vllm_server_weight_sync='ftp'", "'auto', 'nccl', 'files'"],
    "grpo_vllm_tensor_parallel_not_over_the_group": [
        "vllm_tensor_parallel_size=2",
        "sp_generation='replicate'",
        "sp_generation='split'",
    ],
    "grpo_with_rollout_func": ["sp_size > 1", "rollout_func", "sp_size=1"],
}


@pytest.fixture(scope="module")
def bad_input_errors(tmp_path_factory):
    return unwrap_results(run_distributed(2, run_bad_inputs, str(tmp_path_factory.mktemp("bad")), timeout=300))


@pytest.mark.dist
@pytest.mark.parametrize("case", list(EXPECTED))
def test_every_rank_raises_a_clear_error(case, bad_input_errors):
    for rank, errors in enumerate(bad_input_errors):
        message = errors[case]
        assert message.startswith("ValueError"), f"rank {rank}: {message}"
        for fragment in EXPECTED[case]:
            assert fragment in message, f"rank {rank}: {fragment!r} not in {message!r}"


def test_sp_without_distributed_launch(tmp_path):
    from hf_sp_trainer import TrainingArguments

    with pytest.raises(ValueError, match="single-process run"):
        TrainingArguments(output_dir=str(tmp_path), sp_size=2, use_cpu=True, report_to="none")


@pytest.mark.parametrize("sp_size", [0, -2])
def test_sp_size_must_be_positive(sp_size, tmp_path):
    from hf_sp_trainer import TrainingArguments

    with pytest.raises(ValueError, match="positive integer"):
        TrainingArguments(output_dir=str(tmp_path), sp_size=sp_size, use_cpu=True, report_to="none")
