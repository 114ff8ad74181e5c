#!/usr/bin/env bash
# LoRA fine-tuning of Llama-3.1-8B on 512K-token sequences over several nodes of 8 GPUs, sp_size 16 (two nodes per
# sequence; the 8 kv heads are replicated so each of the 16 ranks has its query heads' kv head).
# Run on every node: NNODES=2 NODE_RANK=<0..N-1> MASTER_ADDR=<node 0 host> DATASET=... bash <this script>
# SMOKE=1: CPU smoke test with a tiny model (one machine, 2 processes).
source "$(dirname "$0")/_common.sh"
MAX_LENGTH=${MAX_LENGTH:-524288}
if [ "${SMOKE:-0}" != 1 ]; then
  : "${NNODES:?}" "${NODE_RANK:?}" "${MASTER_ADDR:?}"
  MODEL_ARGS=(--model_name_or_path meta-llama/Llama-3.1-8B --dataset_name "$DATASET")
  HARDWARE_ARGS=(--accelerate_config "$HERE/configs/ddp_multinode.yaml" --num_machines "$NNODES"
                 --num_processes $((8 * NNODES)) --machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR"
                 --main_process_port "${MASTER_PORT:-29500}" --sp_size 16 --attn_implementation flash_attention_2
                 --bf16 true --num_train_epochs 1 --output_dir "${OUTPUT_DIR:-llama3.1-8b-lora-512k}")
fi
exec hf-sp-sft "${MODEL_ARGS[@]}" "${HARDWARE_ARGS[@]}" \
  --max_length "$MAX_LENGTH" --packing --packing_strategy bfd \
  --use_peft --lora_r 16 --lora_alpha 32 --lora_dropout 0 --lora_target_modules all-linear \
  --per_device_train_batch_size 1 --gradient_accumulation_steps 4 --gradient_checkpointing true \
  --learning_rate 2e-4 --lr_scheduler_type cosine --warmup_steps 0.03 --weight_decay 0.0 \
  --logging_steps 1 --save_strategy steps --save_steps 100 --report_to none "$@"
