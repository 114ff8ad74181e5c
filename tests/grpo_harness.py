"""GRPO / RLOO cases: the same run with TRL and with the SP trainers (sampled completions, fp32).

The reference is single-process TRL for dp = 1 and TRL on ``dp`` plain data-parallel processes for dp > 1: TRL seeds
each process with ``seed + process_index``, so a data-parallel rank's completions are those its process samples, and
the SP trainers give each SP group the seed of its data-parallel rank (``OnlineRLSPMixin``).
"""

from __future__ import annotations

import contextlib
import os
import random
import string
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tests.harness import (
    BF16_TOL,
    EXACT,
    backend_args,
    full_parameters,
    logged_throughput_tokens,
    quiet_args,
    reset_backend_state,
    tiny_model,
)

SKIPPED = ("epoch", "step", "tokens_per_second_per_rank", "step_time_s", "peak_memory_mb", "mfu", "step_time")
SKIPPED_EVAL = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch")


@dataclass(frozen=True)
class RLCase:
    name: str
    trainer: str = "grpo"  # grpo | rloo
    family: str = "llama"  # tests.harness.tiny_model's (mixtral: the MoE router aux loss on)
    sp_size: int = 2
    world_size: int = 2
    prompts_per_step: int = 2  # per optimizer step, over all data-parallel ranks
    num_generations: int = 2
    steps: int = 2
    config: dict = field(default_factory=dict)
    ref: bool = False  # beta > 0: the policy is given as a saved path and TRL loads the reference from it
    lora: bool = False
    evaluate: bool = False
    backend: str = "ddp"  # the SP run's: ddp | fsdp2 | zero1-3 (the reference runs plain TRL)
    sp_config: dict = field(default_factory=dict)  # extra config fields for the SP run only
    tol: float = EXACT
    no_op: bool = False  # greedy: every advantage is 0
    compare: bool = True  # False: no TRL run gives the same samples (split generation, sampled)
    vllm: bool = False  # TRL's colocated vLLM engine generates (tests/vllm: the vLLM tier's environment)
    reference: str = "trl"  # the one-process run: "trl" (TRL's trainer), "sp1" (ours at sp_size=1, same sp_config)
    ref_config: dict | None = None  # reference "sp1": its extra config fields instead of sp_config's
    control: str | None = None  # a negative control's injected error (tests/vllm/rollout_cases.py)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def train(self, sp: bool, out_dir: str) -> dict:
        return train_rl_case(self, sp, out_dir)


def rl_dataset(n: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.randint(1, 4)  # prompts of different lengths (left padding), shorter than the completions
        rows.append(
            {"prompt": " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(3)) for _ in range(words))}
        )
    return Dataset.from_list(rows)


def reward_len_and_vowels(completions, **kwargs):
    """Deterministic: a function of the completion text only."""
    return [float(len(c)) / 8.0 + sum(ch in "aeiou" for ch in c) for c in completions]


def recording_reward(seen: list):
    """``reward_len_and_vowels`` that also records the completions it scores on this rank."""

    def reward_len_and_vowels_recorded(completions, **kwargs):
        seen.append(list(completions))
        return reward_len_and_vowels(completions)

    reward_len_and_vowels_recorded.__name__ = "reward_len_and_vowels"  # the metric names
    return reward_len_and_vowels_recorded


def same_within_sp_groups(seen: list, sp_size: int) -> bool:
    """Every rank of each SP group scored the same completions (collective: every rank)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    return all(everyone[r] == everyone[r - r % sp_size] for r in range(len(everyone)))


def save_policy(model, path: str) -> str:
    """Write ``model`` to ``path`` on this rank (``save_pretrained`` writes on rank 0 only under torch.distributed)."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    from transformers.core_model_loading import revert_weight_conversion

    state = revert_weight_conversion(model, model.state_dict())  # the checkpoint layout, as save_pretrained writes
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    return path


def train_rl_case(case: RLCase, sp: bool, out_dir: str) -> dict:
    """One run: the SP trainer (``sp=True``), or TRL's own in this process group (one process, or the dp ranks)."""
    import peft
    import trl

    import hf_sp_trainer as hst
    from hf_sp_trainer.data import build_char_tokenizer

    reset_backend_state()
    config_name, trainer_name = {"grpo": ("GRPOConfig", "GRPOTrainer"), "rloo": ("RLOOConfig", "RLOOTrainer")}[
        case.trainer
    ]
    ours = sp or case.reference == "sp1"
    if ours:
        config_cls, trainer_cls = getattr(hst, config_name), getattr(hst, "SP" + trainer_name)
    else:
        config_cls, trainer_cls = getattr(trl, config_name), getattr(trl, trainer_name)
    dp = int(os.environ.get("WORLD_SIZE", "1")) // (case.sp_size if sp else 1)  # (set before the process group)
    common = quiet_args(out_dir, case.steps) | dict(
        learning_rate=1e-3,
        per_device_train_batch_size=case.prompts_per_step * case.num_generations // dp,
        per_device_eval_batch_size=case.prompts_per_step * case.num_generations // dp,
        num_generations=case.num_generations,
        num_generations_eval=case.num_generations,
        max_completion_length=24,
        bf16=False,
        beta=0.04 if case.ref or case.lora else 0.0,
        shuffle_dataset=False,
        seed=7,
    )
    if case.evaluate:
        common |= dict(eval_strategy="steps", eval_steps=case.steps)
    common |= case.config
    if sp:
        common |= dict(sp_size=case.sp_size) | backend_args(case.backend) | case.sp_config
    elif ours:
        extra = case.sp_config if case.ref_config is None else case.ref_config
        common |= {k: v for k, v in extra.items() if k != "sp_ring_size"}
    vllm = None
    if case.vllm:
        from tests.vllm import rollout_cases as vllm

        common = vllm.config_args(ours, common.get("vllm_mode", "colocate")) | common
    if dist.is_initialized():
        common |= dict(ddp_backend="gloo")
    model = tiny_model(case.family, **(vllm.MODEL if vllm else {}))
    if case.ref or vllm:
        model = save_policy(model, os.path.join(out_dir, "policy"))
        if vllm:
            build_char_tokenizer().save_pretrained(model)  # the engine loads the model's directory
        common["model_init_kwargs"] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    peft_config = None
    if case.lora:
        peft_config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM"
        )
    with vllm.engine(case, ours) if vllm else contextlib.nullcontext():
        trainer = trainer_cls(
            model=model,
            reward_funcs=recording_reward(seen := []),
            args=config_cls(**common),
            train_dataset=rl_dataset(case.prompts_per_step * case.steps * 2, seed=31),
            eval_dataset=rl_dataset(case.prompts_per_step, seed=32) if case.evaluate else None,
            processing_class=build_char_tokenizer(),
            peft_config=peft_config,
        )
    if vllm and sp:
        vllm.inject(case, trainer)
    trainable = {k for k, v in trainer.model.named_parameters() if v.requires_grad}
    init = {k: v for k, v in full_parameters(trainer.model).items() if k in trainable}
    shards = count_shards(trainer.model.get_base_model() if case.lora else trainer.model) if sp else {}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    params = {k: v for k, v in full_parameters(trainer.model).items() if k in trainable}  # collective: every rank
    if vllm:
        vllm.release(trainer)
    return {
        "logs": [{k: v for k, v in e.items() if k not in SKIPPED} for e in logs],
        "evals": [{k: v for k, v in e.items() if k not in SKIPPED_EVAL} for e in evals],
        "global_step": trainer.state.global_step,
        "params": params if rank0 else None,
        "init": init if rank0 else None,
        "model_type": type(trainer.model).__name__,
        "shards": shards,
        "throughput_tokens": logged_throughput_tokens(logs),
        "sp_ranks_agree": same_within_sp_groups(seen, case.sp_size) if sp and dist.is_initialized() else True,
        "split_generations": getattr(trainer, "_sp_generation_calls", 0),
        "completions": seen if rank0 and vllm else None,
    }


def count_shards(model) -> dict[str, int]:
    """Test instrumentation (SP runs): forwards that ran on a shard (the SP hook passes ``shift_labels``), and those
    where a sequence continues on the next rank: this rank's shard does not end with a sequence's last token (the
    only token without a next-token label that follows one with a label); and the tokens of the training forwards
    (gradients on), what the throughput callback must count."""
    counts = {"sharded": 0, "crossing": 0, "training_tokens": 0}

    def hook(module, _args, kwargs):
        if module.training and torch.is_grad_enabled():
            counts["training_tokens"] += kwargs["input_ids"].numel()
        labels = kwargs.get("shift_labels")
        if labels is not None:
            counts["sharded"] += 1
            ends_a_sequence = labels.shape[1] > 1 and labels[0, -1] == -100 and labels[0, -2] != -100
            counts["crossing"] += int(not ends_a_sequence)

    model.register_forward_pre_hook(hook, with_kwargs=True)  # after the SP hook: sees this rank's shard
    return counts


LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
GREEDY = {"generation_kwargs": {"do_sample": False}, "gradient_accumulation_steps": 2}
SGD = {"optim": "sgd", "learning_rate": 0.05}
WORLD2 = [
    RLCase("grpo_sp2_dapo_eval", evaluate=True),
    RLCase("grpo_sp2_grpo_ref_iters2", ref=True, config={"loss_type": "grpo", "num_iterations": 2}),
    RLCase("grpo_sp2_lora_bnpo", lora=True, config={"loss_type": "bnpo"}),
    RLCase(
        "grpo_sp2_dr_grpo_ga2_top_entropy",
        config={"loss_type": "dr_grpo", "gradient_accumulation_steps": 2, "top_entropy_quantile": 0.5},
    ),
    RLCase("grpo_sp2_cispo_entropy_bonus", config={"loss_type": "cispo", "entropy_coef": 0.01}),
    RLCase("grpo_sp2_sapo", config={"loss_type": "sapo"}),
    RLCase("grpo_sp2_luspo_sequence_is", config={"loss_type": "luspo", "importance_sampling_level": "sequence"}),
    RLCase("grpo_sp2_vespo_mask_truncated", config={"loss_type": "vespo", "mask_truncated_completions": True}),
    RLCase("grpo_sp2_ring", config={"loss_type": "grpo"}, sp_config={"sp_ring_size": 2}),
    RLCase("grpo_sp2_zero3_ref", backend="zero3", ref=True, config={"loss_type": "grpo"}),
    RLCase("grpo_sp2_fsdp2", backend="fsdp2"),
    RLCase("grpo_sp2_bf16", config={"bf16": True}, tol=BF16_TOL),  # bf16 autocast on both sides: bf16 round-off
    # split generation, greedy: each rank generates half of the rows; the same completions as TRL (steps are no-ops:
    # greedy completions of one prompt are identical), gathered in order, with TRL's shuffles (grad accum 2)
    RLCase("grpo_sp2_split_greedy", config=GREEDY, sp_config={"sp_generation": "split"}, no_op=True),
    RLCase("rloo_sp2_split_greedy", trainer="rloo", config=GREEDY, sp_config={"sp_generation": "split"}, no_op=True),
    RLCase(
        "grpo_sp2_split_sampled",
        config={"gradient_accumulation_steps": 2},
        sp_config={"sp_generation": "split"},
        compare=False,
    ),
    RLCase(
        "rloo_sp2_zero3_split_greedy",
        trainer="rloo",
        backend="zero3",
        config=GREEDY,
        sp_config={"sp_generation": "split"},
        no_op=True,
    ),
    RLCase("grpo_sp2_zero2_ref", backend="zero2", ref=True),
    RLCase("rloo_sp2_ref", trainer="rloo", ref=True),
    RLCase("rloo_sp2_normalized_iters2", trainer="rloo", config={"normalize_advantages": True, "num_iterations": 2}),
    RLCase("rloo_sp2_fsdp2", trainer="rloo", backend="fsdp2"),
    RLCase(
        "grpo_sp2_fsdp2_split_greedy", backend="fsdp2", config=GREEDY, sp_config={"sp_generation": "split"}, no_op=True
    ),
    RLCase("rloo_sp2_ring_bf16", trainer="rloo", config={"bf16": True}, sp_config={"sp_ring_size": 2}, tol=BF16_TOL),
    RLCase("grpo_sp2_zero1", backend="zero1"),
    # the MoE router aux loss (tiny Mixtral, coefficient 0.5) with SGD, whose step is the gradient as it is
    RLCase(
        "grpo_sp2_mixtral_router_loss_ref_ga2_eval",
        family="mixtral",
        ref=True,
        evaluate=True,
        config={**SGD, "gradient_accumulation_steps": 2},
    ),
    RLCase("rloo_sp2_mixtral_router_loss_lora", trainer="rloo", family="mixtral", lora=True, config=SGD),
    RLCase("grpo_sp2_qwen3_5_gdn", family="qwen3_5", config=SGD),  # a hybrid model (Gated DeltaNet + attention)
]
WORLD4 = [
    RLCase("grpo_dp2sp2", world_size=4, prompts_per_step=4, config={"loss_type": "grpo"}),
    RLCase("rloo_dp2sp2_ref", trainer="rloo", world_size=4, prompts_per_step=4, ref=True),
]
CASES = WORLD2 + WORLD4


def _reference_runs(cases: list[RLCase]) -> dict[str, dict]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return {c.name: train_rl_case(c, sp=False, out_dir=os.path.join(tmp, c.name)) for c in cases}


class RLRuns:
    """A list of cases' SP runs (one spawned world per size) and their references, each computed once: TRL's own
    trainers (or ours at sp_size=1, ``RLCase.reference``) in one process for one dp rank (side by side on the pool's
    ranks), on ``dp`` plain data-parallel processes otherwise."""

    def __init__(self, cases: list[RLCase]):
        self.cases = cases
        self._done: dict = {}

    def _once(self, key, run):
        if key not in self._done:
            self._done[key] = run()
        return self._done[key]

    def sp_results(self, world_size: int) -> dict[str, dict]:
        from tests.harness import only_selected, run_cases, run_distributed, unwrap_results

        cases = only_selected(c for c in self.cases if c.world_size == world_size)
        return self._once(("sp", world_size), lambda: unwrap_results(run_distributed(world_size, run_cases, cases))[0])

    def ddp_references(self, dp_size: int) -> dict[str, dict]:
        from tests.harness import only_selected, run_distributed, unwrap_results

        cases = only_selected(c for c in self.cases if c.dp_size == dp_size)
        return self._once(("ddp", dp_size), lambda: unwrap_results(run_distributed(dp_size, _reference_runs, cases))[0])

    def single_process_references(self) -> dict:
        from tests.harness import only_selected, reference_runs

        one = only_selected(c for c in self.cases if c.dp_size == 1 and c.compare)
        return self._once("one", lambda: reference_runs(one))

    def reference(self, case: RLCase) -> dict:
        if case.dp_size == 1:
            return self.single_process_references()[case.name]()
        return self.ddp_references(case.dp_size)[case.name]


RUNS = RLRuns(CASES)
sp_results, reference = RUNS.sp_results, RUNS.reference


def diffs(ref: dict, got: dict) -> dict[str, float]:
    """Relative differences: every logged training and eval metric (max over steps) and the trained parameters."""
    from tests.harness import rel

    out: dict[str, float] = {}
    for kind in ("logs", "evals"):
        assert len(ref[kind]) == len(got[kind]), (kind, ref[kind], got[kind])
        for r, g in zip(ref[kind], got[kind], strict=True):
            assert r.keys() == g.keys(), (sorted(r), sorted(g))
            for key, value in r.items():
                if value is None:
                    assert g[key] is None, key
                    continue
                # The loss is a mean of advantage-weighted ratios, +-O(1) terms that cancel to ~0 on-policy: it is
                # compared relative to max(|loss|, 1), the size of its terms. The KL is a mean of differences of
                # per-token log-probs (policy - reference): relative to the size of those, for which the logged
                # entropy (the mean -log p) stands in. Alike vLLM's sampling log-probs' distance from the trainer's.
                if key.endswith("loss"):
                    d = abs(g[key] - value) / max(abs(value), 1.0)
                elif key.endswith("kl") or "sampling_logp_difference" in key:  # (vLLM's log-probs vs the trainer's)
                    entropy = r["eval_entropy" if key.startswith("eval_") else "entropy"]
                    d = abs(g[key] - value) / max(abs(value), entropy)
                else:
                    d = rel(g[key], value)
                out[key] = max(out.get(key, 0.0), d)
    names = sorted(ref["params"])
    p = torch.cat([got["params"][k].flatten() for k in names])
    q = torch.cat([ref["params"][k].flatten() for k in names])
    q0 = torch.cat([ref["init"][k].flatten() for k in names])
    out["params"] = float((p - q).norm() / q.norm())
    out["update"] = float((p - q).norm() / (q - q0).norm())
    return out
