"""DPO / reward / KTO cases: the same run with single-process TRL and with the SP trainers (run by ``run_cases``)."""

from __future__ import annotations

import functools
import os
import random
import string
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tests.exactness import assert_exact
from tests.harness import (
    backend_args,
    full_parameters,
    logged_throughput_tokens,
    quiet_args,
    reset_backend_state,
    tiny_model,
)

SKIPPED_LOG_KEYS = ("epoch", "step", "tokens_per_second_per_rank", "step_time_s", "peak_memory_mb", "mfu")
SKIPPED_EVAL_KEYS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch")


@dataclass(frozen=True)
class PrefCase:
    name: str
    trainer: str = "dpo"  # dpo | reward | kto
    family: str = "llama"  # tests.harness.tiny_model's (mixtral: the MoE router aux loss on)
    sp_size: int = 2
    world_size: int = 2
    batch_size: int = 2  # per SP group and micro-step (pairs for DPO / reward, examples for KTO)
    grad_accum: int = 1
    steps: int = 3
    prompt_words: tuple[int, int] = (3, 10)  # a word is 2-6 characters (tokens) and a space
    answer_words: tuple[int, int] = (1, 4)
    config: dict = field(default_factory=dict)  # extra config fields for both runs
    sp_config: dict = field(default_factory=dict)  # extra config fields for the SP run only
    lora: bool = False
    ref: str = "given"  # given: a ref_model built from the config | path: the policy given as a local path
    margin: bool = False  # reward: a margin column

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def train(self, sp: bool, out_dir: str) -> dict:
        return train_pref_case(self, sp, out_dir)


def _words(rng: random.Random, bounds: tuple[int, int]) -> str:
    n = rng.randint(*bounds)
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6))) for _ in range(n))


def pref_dataset(case: PrefCase, n: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = _words(rng, case.prompt_words) + " ->"
        chosen, rejected = " " + _words(rng, case.answer_words), " " + _words(rng, case.answer_words)
        if case.trainer == "dpo":
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        elif case.trainer == "reward":
            row = {"chosen": prompt + chosen, "rejected": prompt + rejected}
            rows.append({**row, "margin": rng.random()} if case.margin else row)
        else:
            rows.append({"prompt": prompt, "completion": chosen, "label": i % 3 != 1})
    return Dataset.from_list(rows)


def _trainer_classes(kind: str, sp: bool):
    import trl

    import hf_sp_trainer as hst

    config, trainer = {
        "dpo": ("DPOConfig", "DPOTrainer"),
        "reward": ("RewardConfig", "RewardTrainer"),
        "kto": ("KTOConfig", "KTOTrainer"),
    }[kind]
    return (getattr(hst, config), getattr(hst, "SP" + trainer)) if sp else (getattr(trl, config), getattr(trl, trainer))


def count_shards(model) -> dict[str, int]:
    """Test instrumentation (SP runs), after the SP hook so that it sees this rank's shards: the forwards whose shard
    holds no completion token, and the tokens of the training forwards (what the throughput callback must count)."""
    counts = {"prompt_only": 0, "training_tokens": 0}

    def hook(module, _args, kwargs):
        labels = kwargs.get("shift_labels")
        if labels is not None and bool((labels == -100).all()):
            counts["prompt_only"] += 1
        if module.training and torch.is_grad_enabled():
            counts["training_tokens"] += kwargs["input_ids"].numel()

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return counts


def build_model(case: PrefCase, out_dir: str, sp: bool):
    """The policy (a model, or the path of a saved one), the reference model (or None) and the tokenizer."""
    from hf_sp_trainer.data import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if case.trainer == "reward":
        import transformers

        config = tiny_model(case.family).config
        config.num_labels = 1
        torch.manual_seed(0)
        model = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
        return model.float(), None, tokenizer
    model = tiny_model(case.family)
    if case.ref == "path":
        path = os.path.join(out_dir, "policy")
        # Every rank writes its own copy: model.save_pretrained writes on rank 0 only once torch.distributed is up
        from safetensors.torch import save_file

        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"))
        return path, None, tokenizer
    return model, (None if case.lora else tiny_model(case.family)), tokenizer


def train_pref_case(case: PrefCase, sp: bool, out_dir: str, ddp: bool = False) -> dict:
    """One run: the SP trainer (``sp``), or TRL's own in one process with the global batch, or (``ddp``, on
    ``dp_size`` spawned ranks) TRL's own as plain data parallelism."""
    import peft

    reset_backend_state()
    config_cls, trainer_cls = _trainer_classes(case.trainer, sp)
    global_batch = case.batch_size * case.dp_size
    per_device = case.batch_size if sp or ddp else global_batch
    train = pref_dataset(case, global_batch * case.grad_accum * case.steps, seed=21)
    evals = pref_dataset(case, 2 * global_batch, seed=22)
    common = quiet_args(out_dir, case.steps) | dict(
        learning_rate=1e-3,
        gradient_accumulation_steps=case.grad_accum,
        per_device_eval_batch_size=per_device,
        per_device_train_batch_size=per_device,
        dataset_num_proc=None,
        bf16=False,  # the equivalence is checked in fp32
        max_length=None,
    )
    if case.trainer == "kto":
        common["train_sampling_strategy"] = "sequential"
    common |= case.config
    if sp:
        common |= dict(sp_size=case.sp_size, ddp_backend="gloo") | case.sp_config
    elif ddp:
        common |= dict(ddp_backend="gloo")
    peft_config = None
    if case.lora:
        task = "SEQ_CLS" if case.trainer == "reward" else "CAUSAL_LM"
        peft_config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"], task_type=task
        )
    model, ref_model, tokenizer = build_model(case, out_dir, sp)  # a saved policy stays there while TRL loads it
    extra = {} if case.trainer == "reward" else {"ref_model": ref_model}
    trainer = trainer_cls(
        model=model,
        args=config_cls(**common),
        train_dataset=train,
        eval_dataset=evals,
        processing_class=tokenizer,
        peft_config=peft_config,
        **extra,
    )
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    shards = count_shards(base) if sp else {"prompt_only": 0, "training_tokens": 0}
    init = full_parameters(trainer.model)
    trainer.train()
    eval_metrics = trainer.evaluate()
    predictions = None
    if case.trainer == "reward":
        prediction = trainer.predict(trainer.eval_dataset.select(range(global_batch)))
        predictions = torch.as_tensor(prediction.predictions).float()
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    rank0 = not (sp or ddp) or dist.get_rank() == 0
    params = full_parameters(trainer.model)  # collective under ZeRO-3 / FSDP2: every rank
    return {
        "losses": [e["loss"] for e in logs],
        "grad_norms": [e["grad_norm"] for e in logs],
        "logs": [{k: v for k, v in e.items() if k not in SKIPPED_LOG_KEYS} for e in logs],
        "eval": {k: v for k, v in eval_metrics.items() if k not in SKIPPED_EVAL_KEYS},
        "eval_loss": eval_metrics["eval_loss"],
        "reward_predictions": predictions,
        "global_step": trainer.state.global_step,
        "prompt_only_shards": shards["prompt_only"],
        "shard_tokens": shards["training_tokens"],
        "throughput_tokens": logged_throughput_tokens(logs),
        "params": params if rank0 else None,
        "init": init if rank0 else None,
        "model_type": type(trainer.model).__name__,
    }


def metric_diffs(ref: dict, got: dict, beta: float = 0.1) -> dict[str, float]:
    """Relative difference of every logged training metric (max over steps), every eval metric and the reward
    predictions.

    Rewards, margins and KTO's KL are differences of much larger numbers (``beta * (logp - ref_logp)``,
    ``chosen - rejected`` scores), so fp32 round-off of those operands is their natural unit: they are compared
    relative to ``max(|value|, scale)``, with ``scale`` the size of the operands in the same log entry (``beta x``
    the largest ``|logps|``, or the largest ``|reward|`` of a reward model).
    """
    from tests.harness import rel

    def scale(entry: dict, key: str) -> float:
        name = key.removeprefix("eval_")
        prefix = key[: len(key) - len(name)]
        logps = [abs(v) for k, v in entry.items() if k.startswith(prefix + "logps/")]
        if name == "kl" and logps:  # mean(KL_logps - ref_KL_logps): no beta
            return max(logps)
        if "rewards/" in name or "margin" in name:
            if logps:
                return beta * max(logps)
        if "rewards/" in name or "margin" in name or name.endswith("_reward"):  # reward model scores
            return max(abs(entry.get(prefix + k, 0.0)) for k in ("min_reward", "max_reward", "mean_reward"))
        return 0.0

    def diff(a: float, b: float, entry: dict, key: str) -> float:
        return abs(a - b) / max(abs(b), scale(entry, key), 1e-12) if scale(entry, key) else rel(a, b)

    diffs: dict[str, float] = {}
    assert len(ref["logs"]) == len(got["logs"])
    for r, g in zip(ref["logs"], got["logs"], strict=True):
        for key, value in r.items():
            diffs[key] = max(diffs.get(key, 0.0), diff(g[key], value, r, key))
    for key, value in ref["eval"].items():
        diffs[key] = diff(got["eval"][key], value, ref["eval"], key)
    if ref["reward_predictions"] is not None:
        # per-DP-rank batches put their chosen rows before their rejected rows, so compare the scores as a set
        p, q = (x.flatten().sort().values for x in (got["reward_predictions"], ref["reward_predictions"]))
        diffs["predictions"] = float((p - q).norm() / q.norm())
    return diffs


# ----------------------------------------------------------------------------------------------------------------
# the cases: one spawned process group per world size for DPO, reward and KTO together (tests/test_{dpo,reward,kto})
# ----------------------------------------------------------------------------------------------------------------
SGD = {"optim": "sgd", "learning_rate": 0.05}
LONG_PROMPT = dict(prompt_words=(9, 14), answer_words=(1, 3), batch_size=1)  # a completion starts on another shard
WORLD2 = [
    PrefCase("dpo_ref_model_ga2", grad_accum=2, **LONG_PROMPT),
    PrefCase("dpo_ref_built_by_trl_sigmoid_sft", ref="path", config={"loss_type": ["sigmoid", "sft"]}),
    PrefCase("dpo_lora_ld_alpha_wpo", lora=True, config={"ld_alpha": 0.5, "use_weighting": True}),
    PrefCase("dpo_ring", sp_config={"sp_ring_size": 2}, config={"loss_type": ["ipo"]}),
    PrefCase("reward_margin_centered", trainer="reward", margin=True, config={"center_rewards_coefficient": 0.01}),
    PrefCase("reward_lora", trainer="reward", lora=True, **LONG_PROMPT),
    PrefCase("kto_ref_model", trainer="kto", batch_size=3),
    PrefCase("kto_lora_ga2", trainer="kto", batch_size=3, lora=True, grad_accum=2),
    PrefCase("dpo_zero3_ref_model", sp_config=backend_args("zero3")),
    PrefCase("kto_fsdp2", trainer="kto", batch_size=3, sp_config=backend_args("fsdp2")),
    # the MoE router aux loss (tiny Mixtral, coefficient 0.5; policy only) with SGD: the gradient as it is
    PrefCase("dpo_mixtral_router_loss_ga2", family="mixtral", grad_accum=2, config=SGD),
    PrefCase("kto_mixtral_router_loss", trainer="kto", family="mixtral", batch_size=3, config=SGD),
    # a hybrid model (Gated DeltaNet + attention): TRL pads each sequence in its own row, each document alone
    PrefCase("dpo_qwen3_5_gdn", family="qwen3_5", config=SGD),
]
WORLD4 = [
    PrefCase("dpo_dp2sp2", world_size=4),
    PrefCase("dpo_sp4_prompt_only_shards", world_size=4, sp_size=4, **LONG_PROMPT),
    PrefCase("reward_dp2sp2_lora", trainer="reward", world_size=4, lora=True),
    # TRL pairs KTO's KL completions within each data-parallel rank's batch: the reference is TRL on 2 DDP processes
    PrefCase("kto_dp2sp2_ddp_reference", trainer="kto", world_size=4, batch_size=3),
]
DDP_REFERENCE = ("kto",)  # trainers whose dp > 1 reference is TRL on dp processes, not one process


@functools.cache
def sp_results(world_size: int) -> dict[str, dict]:
    """Every case of this world size trained by the SP trainers in one spawned gloo group (rank 0's results)."""
    from tests.harness import only_selected, run_cases, run_distributed, unwrap_results

    cases = only_selected(c for c in WORLD2 + WORLD4 if c.world_size == world_size)
    return unwrap_results(run_distributed(world_size, run_cases, cases))[0]


def _reference_runs(cases: list[PrefCase]) -> dict[str, dict]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return {c.name: train_pref_case(c, sp=False, out_dir=os.path.join(tmp, c.name), ddp=True) for c in cases}


@functools.cache
def ddp_references(dp_size: int) -> dict[str, dict]:
    """TRL's own trainers on ``dp_size`` plain data-parallel processes, for the cases that need them (rank 0's)."""
    from tests.harness import only_selected, run_distributed, unwrap_results

    cases = only_selected(c for c in WORLD2 + WORLD4 if c.dp_size == dp_size and c.trainer in DDP_REFERENCE)
    return unwrap_results(run_distributed(dp_size, _reference_runs, cases))[0]


def _ddp_reference(case: PrefCase) -> bool:
    return case.dp_size > 1 and case.trainer in DDP_REFERENCE


@functools.cache
def single_process_references(trainer: str) -> dict:
    """TRL's own ``trainer`` in one process for its cases without a dp reference (side by side on the pool's ranks)."""
    from tests.harness import only_selected, reference_runs

    return reference_runs(only_selected(c for c in WORLD2 + WORLD4 if c.trainer == trainer and not _ddp_reference(c)))


def check_case(case: PrefCase) -> dict[str, float]:
    """Train ``case`` with TRL (one process, or dp processes for ``DDP_REFERENCE`` trainers), compare with its SP
    run, assert every figure exact (``exactness.assert_exact``)."""
    from tests.harness import assert_throughput_counts, compare

    got = sp_results(case.world_size)[case.name]
    if _ddp_reference(case):
        ref = ddp_references(case.dp_size)[case.name]
    else:
        ref = single_process_references(case.trainer)[case.name]()
    diffs = compare(ref, got) | metric_diffs(ref, got, beta=case.config.get("beta", 0.1))
    print(case.name, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert got["global_step"] == ref["global_step"] == case.steps
    assert got["model_type"].removeprefix("FSDP") == ref["model_type"]  # FSDP2 renames the class it shards
    assert ("Peft" in got["model_type"]) == case.lora
    assert_throughput_counts(got["throughput_tokens"], got["shard_tokens"], case.name)
    assert_exact(case.name, {k: v for k, v in diffs.items() if k not in ("params_tensor", "update")})  # informational
    return got
