#!/usr/bin/env bash
# LoRA DPO of Qwen3-8B on 64K-token preference pairs, one node of 8 GPUs, sp_size 8: each chosen/rejected sequence is
# split over the 8 GPUs; the reference is the adapter-disabled policy, run sharded too. Needs a CUDA GPU and the
# flash extra; DATASET: a hub name or local json/jsonl/parquet file with prompt / chosen / rejected columns.
# SMOKE=1: the same recipe on CPU with a tiny model and dataset built offline, 2 processes, sp_size 2, 2 steps.
set -euo pipefail
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_DIR=${SMOKE_DIR:-$(mktemp -d)}
  python -m hf_sp_trainer.cli.tiny "$SMOKE_DIR" > /dev/null
  MODEL_ARGS=(--model_name_or_path "$SMOKE_DIR/model" --dataset_name "$SMOKE_DIR/dpo.jsonl")
  HARDWARE_ARGS=(--num_processes 2 --sp_size 2 --attn_implementation sdpa --bf16 false --max_steps 2
                 --output_dir "$SMOKE_DIR/out")
  MAX_LENGTH=1024
else
  : "${DATASET:?set DATASET to a preference dataset (prompt / chosen / rejected)}"
  MODEL_ARGS=(--model_name_or_path Qwen/Qwen3-8B --dataset_name "$DATASET")
  HARDWARE_ARGS=(--num_processes 8 --sp_size 8 --attn_implementation flash_attention_2 --bf16 true
                 --num_train_epochs 1 --output_dir "${OUTPUT_DIR:-qwen3-8b-lora-dpo-64k}")
  MAX_LENGTH=${MAX_LENGTH:-65536}
fi
exec python -m hf_sp_trainer.cli.trl_commands dpo "${MODEL_ARGS[@]}" "${HARDWARE_ARGS[@]}" \
  --max_length "$MAX_LENGTH" --truncation_mode keep_end --beta 0.1 --loss_type sigmoid \
  --use_peft --lora_r 32 --lora_alpha 64 --lora_dropout 0 --lora_target_modules all-linear \
  --per_device_train_batch_size 1 --gradient_accumulation_steps 8 --activation_checkpointing true --tiled_mlp true \
  --learning_rate 5e-6 --lr_scheduler_type cosine --warmup_steps 0.03 \
  --logging_steps 1 --save_strategy steps --save_steps 200 --report_to none "$@"
