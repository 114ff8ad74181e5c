"""The built-in main job: ``hf-sp-sft`` with no model or dataset trains a small Llama-style model (config shipped in
the package) on synthetic passkey-retrieval documents, on CPU with 2 processes and sp_size 2, then reports eval loss
and retrieval accuracy. Every default below can be overridden with the usual flags."""

from __future__ import annotations

import os
import time

OUTPUT_DIR = "hf-sp-sft-main-job"
DEFAULT_FLAGS = {  # tuned so the job finishes in a few minutes on 2 CPU cores
    "--sp_size": "2",
    "--output_dir": OUTPUT_DIR,
    "--num_train_epochs": "1",
    "--per_device_train_batch_size": "1",
    "--per_device_eval_batch_size": "1",
    "--learning_rate": "3e-3",
    "--lr_scheduler_type": "cosine",
    "--warmup_steps": "0.05",
    "--weight_decay": "0.0",
    "--logging_steps": "50",
    "--eval_strategy": "no",
    "--save_strategy": "no",
    "--report_to": "none",
    "--bf16": "false",
    "--gradient_checkpointing": "false",
    "--completion_only_loss": "false",
    "--dataset_num_proc": "1",
}
TRAIN_EXAMPLES, TRAIN_CHARS = 650, (2048, 4096)  # one epoch: 650 steps, about 3 minutes on 2 cores
EVAL_EXAMPLES, EVAL_CHARS = 8, (2048, 16384)


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


def run(training_args, model_args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from ..data import build_char_tokenizer
    from ..data.passkey import passkey_dataset, retrieval_accuracy
    from ..sft import SPSFTTrainer

    start = time.time()
    torch.manual_seed(training_args.seed)
    tokenizer = build_char_tokenizer()
    train = passkey_dataset(TRAIN_EXAMPLES, *TRAIN_CHARS, seed=training_args.seed)
    evals = passkey_dataset(EVAL_EXAMPLES, *EVAL_CHARS, seed=training_args.seed + 1)
    trainer = SPSFTTrainer(
        model=build_model(model_args.attn_implementation),
        args=training_args,
        train_dataset=train,
        eval_dataset=evals,
        processing_class=tokenizer,
    )
    first = trainer.evaluate()["eval_loss"]
    trainer.train()
    last = trainer.evaluate()["eval_loss"]
    trainer.save_model(training_args.output_dir)
    tokenizer.save_pretrained(training_args.output_dir)
    trainer.save_state()
    if trainer.is_world_process_zero():
        torch.set_num_threads(max(1, os.cpu_count() or 1))  # the other rank is idle now
        model = AutoModelForCausalLM.from_pretrained(training_args.output_dir, attn_implementation="sdpa")
        accuracy = retrieval_accuracy(model.eval(), tokenizer, evals)
        out = os.path.abspath(training_args.output_dir)
        print(
            f"\nMain job done in {time.time() - start:.0f} s on {trainer.args.world_size} processes "
            f"(sp_size={training_args.sp_size}).\n"
            f"  eval loss: {first:.3f} -> {last:.3f} (passkey documents of {EVAL_CHARS[0]}-{EVAL_CHARS[1]} tokens)\n"
            f"  passkey retrieval accuracy: {accuracy:.1%} of {len(evals)} held-out documents\n"
            f"  model saved to {out}\n\n"
            "At scale on GPUs (one node of 8), e.g. Llama-3.1-8B with LoRA at 128K tokens:\n"
            "  hf-sp-sft --num_processes 8 --sp_size 8 --model_name_or_path meta-llama/Llama-3.1-8B \\\n"
            "    --dataset_name <your dataset> --max_length 131072 --packing --use_peft --lora_r 16 \\\n"
            "    --attn_implementation flash_attention_2 --bf16 --gradient_checkpointing\n"
            "  (see scripts/lora/ for ready-made launch scripts and accelerate configs)"
        )
    trainer.end()
