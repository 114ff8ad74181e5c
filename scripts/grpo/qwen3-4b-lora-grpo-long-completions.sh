#!/usr/bin/env bash
# LoRA GRPO of Qwen3-4B with completions of up to 32K tokens, one node of 8 GPUs, sp_size 8: generation runs with the
# model's own attention, each GPU generating 1/8 of the group's completions (--sp_generation split); scoring
# prompt + completion (policy, and the reference = the adapter-disabled policy) is split over the 8 GPUs. Needs a CUDA
# GPU, the flash extra and `pip install math-verify` (accuracy_reward). DATASET: a hub name or local
# json/jsonl/parquet file with a `prompt` and a `solution` column (e.g. trl-lib/DeepMath-103K).
# SMOKE=1: the same recipe on CPU with a tiny model, prompts and a length reward built offline, 2 processes, sp_size 2,
# 2 steps.
set -euo pipefail
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_DIR=${SMOKE_DIR:-$(mktemp -d)}
  python -m hf_sp_trainer.cli.tiny "$SMOKE_DIR" > /dev/null
  # a reward given as a dotted import path, found from the working directory as with `trl grpo`
  printf 'def vowels(completions, **kwargs):\n    return [float(sum(c in "aeiou" for c in x)) for x in completions]\n' \
    > "$SMOKE_DIR/smoke_rewards.py"
  cd "$SMOKE_DIR"
  MODEL_ARGS=(--model_name_or_path "$SMOKE_DIR/model" --dataset_name "$SMOKE_DIR/prompts.jsonl"
              --reward_funcs smoke_rewards.vowels)
  HARDWARE_ARGS=(--num_processes 2 --sp_size 2 --attn_implementation sdpa --bf16 false --max_steps 2
                 --output_dir "$SMOKE_DIR/out")
  LENGTHS=(--max_completion_length 64)
else
  : "${DATASET:?set DATASET to a dataset with prompt / solution columns (e.g. trl-lib/DeepMath-103K)}"
  MODEL_ARGS=(--model_name_or_path Qwen/Qwen3-4B --dataset_name "$DATASET"
              --reward_funcs accuracy_reward think_format_reward)
  HARDWARE_ARGS=(--num_processes 8 --sp_size 8 --attn_implementation flash_attention_2 --bf16 true
                 --num_train_epochs 1 --output_dir "${OUTPUT_DIR:-qwen3-4b-lora-grpo-32k}")
  LENGTHS=(--max_completion_length "${MAX_COMPLETION_LENGTH:-32768}")
fi
exec python -m hf_sp_trainer.cli.trl_commands grpo "${MODEL_ARGS[@]}" "${HARDWARE_ARGS[@]}" "${LENGTHS[@]}" \
  --num_generations 8 --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --loss_type dapo --beta 0.0 \
  --sp_generation split \
  --use_peft --lora_r 32 --lora_alpha 64 --lora_dropout 0 --lora_target_modules all-linear \
  --activation_checkpointing true --tiled_mlp true --learning_rate 1e-5 --lr_scheduler_type cosine --warmup_steps 0.03 \
  --logging_steps 1 --save_strategy steps --save_steps 100 --report_to none "$@"
