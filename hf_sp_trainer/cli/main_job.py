"""The built-in main job: ``hf-sp-sft`` with no model or dataset.

A small Llama-style model (config shipped in the package, character tokenizer built offline) learns to retrieve a
key hidden in a long document, on CPU, with 2 processes and sp_size 2: each rank holds half of every sequence. The
documents are made on the fly (``hf_sp_trainer.data.passkey``): a curriculum of short documents (the retrieval
circuit forms on them cheaply) then long ones up to 8K tokens. Evaluation runs through the real SP path on held-out
documents whose key sits, for half of them, in the *other* rank's shard, and again with attention restricted to
each rank's shard (the control: without cross-shard attention those keys are out of reach). Every default below can
be overridden with the usual flags.
"""

from __future__ import annotations

import os
import time

OUTPUT_DIR = "hf-sp-sft-main-job"
BATCH, SHORT_BATCHES, LONG_BATCHES = 32, 400, 200  # the curriculum: 600 optimizer steps
EVAL_PER_LENGTH, EVAL_LENGTHS = 8, (512, 1024, 2048, 4096, 8192)  # 40 held-out documents, half cross-shard
DEFAULT_FLAGS = {  # about 5 minutes on 2 CPU cores
    "--sp_size": "2",
    "--output_dir": OUTPUT_DIR,
    "--num_train_epochs": "1",
    "--per_device_train_batch_size": str(BATCH),
    "--train_sampling_strategy": "sequential",  # the dataset order is the curriculum
    "--padding_free": "true",  # one flat row per batch at any sp_size (no padding to the longest document)
    "--max_length": "none",  # documents are at most 8K tokens and must stay whole
    "--learning_rate": "3e-3",
    "--lr_scheduler_type": "cosine_with_min_lr",  # the long documents still get 30% of the peak rate
    "--lr_scheduler_kwargs": '{"min_lr_rate": 0.3}',
    "--warmup_steps": "10",
    "--weight_decay": "0.0",
    "--logging_steps": "25",
    "--eval_strategy": "no",
    "--save_strategy": "no",
    "--report_to": "none",
    "--bf16": "false",
    "--activation_checkpointing": "false",
    "--ddp_find_unused_parameters": "false",  # every parameter gets a gradient: no extra graph traversal
    "--dataset_num_proc": "1",
}


def is_requested(*parsed) -> bool:
    """No model and no dataset among the parsed arguments (a namespace, or TRL's script/model/dataset dataclasses)."""
    names = ("model_name_or_path", "dataset_name", "datasets")
    return not any(getattr(p, name, None) for p in parsed for name in names)


def default_argv(argv: list[str]) -> list[str]:
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    extra = [item for flag, value in DEFAULT_FLAGS.items() if flag not in given for item in (flag, value)]
    return [*argv, *extra]


def default_launch_args(launch_args: list[str]) -> list[str]:
    if any(arg.split("=", 1)[0] in ("--num_processes", "--accelerate_config", "--config_file") for arg in launch_args):
        return launch_args
    return ["--num_processes", "2", *launch_args]


def build_model(attn_implementation: str | None):
    import importlib.resources

    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig.from_json_file(str(importlib.resources.files("hf_sp_trainer.data") / "tiny_llama.json"))
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation or "sdpa")


def sp_retrieval(trainer, tokenizer, dataset, sp_size: int, restrict_to_shard: bool = False) -> dict:
    """Teacher-forced retrieval accuracy through the trained SP model on every rank (``sp_size == 1``: one process).

    ``restrict_to_shard``: SP is detached first, so each rank's attention sees its own shard only (global positions
    kept), the control without cross-shard attention. Returns overall / in-shard / cross-shard accuracy and counts.
    """
    import torch

    from ..data.passkey import encode_example
    from ..model.decoder import unwrap_peft

    model = unwrap_peft(trainer.model).eval()
    if restrict_to_shard and trainer.sp is not None:
        trainer.sp.detach()
    results = []
    with torch.no_grad():
        for row in dataset:
            ex = encode_example(tokenizer, row, sp_size)
            n, ids = ex["num_tokens"], torch.tensor([ex["input_ids"]])
            batch = {"input_ids": ids, "position_ids": torch.arange(n)[None]}
            if trainer.sp is not None:
                shard = trainer.sp.shard_batch(batch)
                logits = trainer.sp.gather_sequence(model(**shard, use_cache=False).logits)[0, :n]
            elif restrict_to_shard:  # one process: the shards one after the other
                from ..data.passkey import shard_bounds

                logits = torch.cat([model(input_ids=ids[:, a:b], position_ids=batch["position_ids"][:, a:b]).logits[0]
                                    for a, b in shard_bounds(n, sp_size) if b > a])  # fmt: skip
            else:
                logits = model(**batch, use_cache=False).logits[0]
            answer = ex["answer_positions"]
            correct = bool((logits[[t - 1 for t in answer]].argmax(-1) == ids[0, answer]).all())
            results.append((correct, ex["cross_shard"], row["length"]))
    cross = [c for c, x, _ in results if x]
    inside = [c for c, x, _ in results if not x]
    lengths = sorted({n for *_, n in results})
    return {
        "accuracy": sum(c for c, *_ in results) / len(results),
        "cross_shard": (sum(cross), len(cross)),
        "in_shard": (sum(inside), len(inside)),
        "by_length": {n: (sum(c for c, _, m in results if m == n), sum(m == n for *_, m in results)) for n in lengths},
    }


def _peak_mb_per_rank() -> list[float]:
    import torch
    import torch.distributed as dist

    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    if not dist.is_initialized():
        return [peak]
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([peak]))
    return [float(t) for t in gathered]


def _fraction(pair: tuple[int, int]) -> str:
    right, total = pair
    return f"{right}/{total} ({right / max(total, 1):.0%})"


def run(training_args, model_args) -> None:
    import torch

    from ..data import build_char_tokenizer
    from ..data.passkey import passkey_curriculum_dataset, passkey_eval_dataset, tokenize_completions
    from ..trainers.sft import SPSFTTrainer

    start = time.time()
    seed = training_args.seed
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    documents = passkey_curriculum_dataset(seed, BATCH, short_batches=SHORT_BATCHES, long_batches=LONG_BATCHES)
    train = tokenize_completions(documents, tokenizer)  # the loss on the key (+ EOS): the filler is random
    trainer = SPSFTTrainer(
        model=build_model(model_args.attn_implementation),
        args=training_args,
        train_dataset=train,
        processing_class=tokenizer,
    )
    sp_size = trainer.args.sp_size  # an int, "auto" resolved
    evals = passkey_eval_dataset(EVAL_PER_LENGTH, EVAL_LENGTHS, seed=seed + 1, sp_size=max(sp_size, 2))
    setup_s = time.time() - start
    output = trainer.train()
    train_s = output.metrics["train_runtime"]
    steps = trainer.state.global_step
    tokens = sum(len(ids) for ids in train.select(range(min(len(train), steps * BATCH)))["input_ids"])
    trainer.save_model(training_args.output_dir)
    tokenizer.save_pretrained(training_args.output_dir)
    trainer.save_state()
    shards = max(sp_size, 2)  # with one process, the control splits each document as 2 ranks would
    full = sp_retrieval(trainer, tokenizer, evals, shards)
    control = sp_retrieval(trainer, tokenizer, evals, shards, restrict_to_shard=True)
    peaks = _peak_mb_per_rank()
    if trainer.is_world_process_zero():
        world = trainer.args.world_size
        print(
            f"\nMain job done in {time.time() - start:.0f} s on {world} process(es) (sp_size={sp_size}): "
            f"setup {setup_s:.0f} s, training {train_s:.0f} s ({steps} steps).\n"
            f"  retrieval accuracy on {len(evals)} held-out documents of {EVAL_LENGTHS[0]}-{EVAL_LENGTHS[-1]} tokens: "
            f"{full['accuracy']:.1%}\n"
            f"    key in the other rank's shard (cross-shard): {_fraction(full['cross_shard'])}\n"
            f"    key in the question's own shard (in-shard):  {_fraction(full['in_shard'])}\n"
            f"    by length: {', '.join(f'{n}: {a}/{b}' for n, (a, b) in full['by_length'].items())}\n"
            f"  control, attention restricted to each rank's shard: cross-shard {_fraction(control['cross_shard'])}, "
            f"in-shard {_fraction(control['in_shard'])} (chance: 1 in 1690)\n"
            f"  throughput: {tokens / train_s:,.0f} tokens/s ({tokens / train_s / world:,.0f} per rank); "
            f"peak memory per rank: {', '.join(f'{p:.0f} MB' for p in peaks)}\n"
            f"  model saved to {os.path.abspath(training_args.output_dir)}\n\n"
            "Next, at scale on GPUs (one node of 8), e.g. Llama-3.1-8B with LoRA at 128K tokens:\n"
            "  hf-sp-plan --model meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory-gib 80 --lora   # will it fit?\n"
            "  hf-sp-sft --num_processes 8 --sp_size 8 --model_name_or_path meta-llama/Llama-3.1-8B \\\n"
            "    --dataset_name <your dataset> --max_length 131072 --packing --use_peft --lora_r 16 --bf16 \\\n"
            "    --activation_checkpointing --tiled_mlp\n"
            "  (scripts/lora/ has ready-made launch scripts; README: Ulysses x Ring for any head count)"
        )
    trainer.end()
