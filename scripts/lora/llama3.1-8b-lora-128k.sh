#!/usr/bin/env bash
# LoRA fine-tuning of Llama-3.1-8B on 128K-token sequences, one node of 8 GPUs (H100/H200 80+ GB), sp_size 8.
# Needs: pip install -e ".[flash]" (flash-attn), access to meta-llama/Llama-3.1-8B, DATASET of long documents.
# Usage: DATASET=my/long-docs bash scripts/lora/llama3.1-8b-lora-128k.sh [extra hf-sp-sft flags]
#        SMOKE=1 bash scripts/lora/llama3.1-8b-lora-128k.sh        # CPU smoke test with a tiny model
source "$(dirname "$0")/_common.sh"
MAX_LENGTH=${MAX_LENGTH:-131072}
if [ "${SMOKE:-0}" != 1 ]; then
  MODEL_ARGS=(--model_name_or_path meta-llama/Llama-3.1-8B --dataset_name "$DATASET")
  HARDWARE_ARGS=(--accelerate_config "$HERE/configs/ddp_8gpu.yaml" --sp_size 8 --attn_implementation flash_attention_2
                 --bf16 true --num_train_epochs 1 --output_dir "${OUTPUT_DIR:-llama3.1-8b-lora-128k}")
fi
exec hf-sp-sft "${MODEL_ARGS[@]}" "${HARDWARE_ARGS[@]}" \
  --max_length "$MAX_LENGTH" --packing --packing_strategy bfd \
  --use_peft --lora_r 16 --lora_alpha 32 --lora_dropout 0 --lora_target_modules all-linear \
  --per_device_train_batch_size 1 --gradient_accumulation_steps 8 --gradient_checkpointing true \
  --learning_rate 2e-4 --lr_scheduler_type cosine --warmup_steps 0.03 --weight_decay 0.0 \
  --logging_steps 1 --save_strategy steps --save_steps 200 --report_to none "$@"
