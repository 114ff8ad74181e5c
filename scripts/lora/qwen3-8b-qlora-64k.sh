#!/usr/bin/env bash
# QLoRA (4-bit NF4 base weights) fine-tuning of Qwen3-8B on 64K-token sequences, one node of 8 GPUs, sp_size 8.
# Needs: a CUDA GPU, pip install bitsandbytes, and the flash extra. SMOKE=1: CPU smoke test with a tiny model
# (no 4-bit: bitsandbytes needs a GPU).
source "$(dirname "$0")/_common.sh"
MAX_LENGTH=${MAX_LENGTH:-65536}
QUANT_ARGS=()
if [ "${SMOKE:-0}" != 1 ]; then
  MODEL_ARGS=(--model_name_or_path Qwen/Qwen3-8B --dataset_name "$DATASET")
  HARDWARE_ARGS=(--accelerate_config "$HERE/configs/ddp_8gpu.yaml" --sp_size 8 --attn_implementation flash_attention_2
                 --bf16 true --num_train_epochs 1 --output_dir "${OUTPUT_DIR:-qwen3-8b-qlora-64k}")
  QUANT_ARGS=(--load_in_4bit --bnb_4bit_quant_type nf4 --use_bnb_nested_quant --dtype bfloat16)
fi
exec hf-sp-sft "${MODEL_ARGS[@]}" "${HARDWARE_ARGS[@]}" "${QUANT_ARGS[@]}" \
  --max_length "$MAX_LENGTH" --packing --packing_strategy bfd \
  --use_peft --lora_r 32 --lora_alpha 64 --lora_dropout 0 --lora_target_modules all-linear \
  --per_device_train_batch_size 1 --gradient_accumulation_steps 8 --gradient_checkpointing true \
  --learning_rate 1e-4 --lr_scheduler_type cosine --warmup_steps 0.03 --weight_decay 0.0 \
  --logging_steps 1 --save_strategy steps --save_steps 200 --report_to none "$@"
