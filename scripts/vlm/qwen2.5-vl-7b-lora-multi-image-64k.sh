#!/usr/bin/env bash
# LoRA SFT of Qwen2.5-VL-7B-Instruct on long multi-image conversations (TRL's vision format: `messages` + `images`,
# e.g. many-page documents or long screenshot sessions), one node of 8 GPUs, sp_size 8. Each micro-batch's
# conversations are packed into one padding-free row (SPSFTTrainer; TRL alone refuses packing for vision data), SP
# runs in the text decoder only, every rank encodes the row's images and keeps its own placeholders' features.
# LoRA on the decoder's attention projections (Qwen2.5-VL's vision blocks name theirs qkv / proj): the tower stays
# frozen and is encoded under no_grad.
# Needs: CUDA GPUs, the flash extra, pip install torchvision (Qwen-VL's processor).
# SMOKE=1: the same recipe on a tiny LLaVA built offline (Qwen-VL's processor needs torchvision), 2 CPU processes,
# sp_size 2, 2 steps.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_DIR=${SMOKE_DIR:-$(mktemp -d)}
  python -m hf_sp_trainer.cli.tiny "$SMOKE_DIR" --vlm
  MODEL_ARGS=(--model_name_or_path "$SMOKE_DIR/vlm" --dataset_name "$SMOKE_DIR/vision.parquet")
  HARDWARE_ARGS=(--num_processes 2 --sp_size 2 --attn_implementation sdpa --bf16 false --dtype float32 --max_steps 2
                 --output_dir "$SMOKE_DIR/out")
  BATCH=${BATCH:-4}
else
  : "${DATASET:?set DATASET to a hub dataset or a local parquet file with messages + images columns}"
  MODEL_ARGS=(--model_name_or_path Qwen/Qwen2.5-VL-7B-Instruct --dataset_name "$DATASET")
  HARDWARE_ARGS=(--accelerate_config "$HERE/../lora/configs/ddp_8gpu.yaml" --sp_size 8
                 --attn_implementation flash_attention_2 --bf16 true --dtype bfloat16 --num_train_epochs 1
                 --output_dir "${OUTPUT_DIR:-qwen2.5-vl-7b-lora-multi-image}")
  BATCH=${BATCH:-16}  # conversations packed into one row per micro-batch: size it to ~64K tokens
fi
exec hf-sp-sft "${MODEL_ARGS[@]}" "${HARDWARE_ARGS[@]}" \
  --max_length 65536 --per_device_train_batch_size "$BATCH" --gradient_accumulation_steps 4 \
  --use_peft --lora_r 16 --lora_alpha 32 --lora_dropout 0 --lora_target_modules q_proj k_proj v_proj o_proj \
  --gradient_checkpointing true --learning_rate 1e-4 --lr_scheduler_type cosine --warmup_steps 0.03 \
  --logging_steps 1 --save_strategy steps --save_steps 200 --report_to none "$@"
