# Shared by the LoRA launch scripts. SMOKE=1 swaps in a tiny model and dataset built offline and runs the same recipe
# on CPU with 2 processes and sp_size 2 for 2 steps (what the tests run); everything else stays as in the real run.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_DIR=${SMOKE_DIR:-$(mktemp -d)}
  python -m hf_sp_trainer.cli.tiny "$SMOKE_DIR"
  MODEL_ARGS=(--model_name_or_path "$SMOKE_DIR/model" --dataset_name "$SMOKE_DIR/data.jsonl")
  HARDWARE_ARGS=(--num_processes 2 --sp_size 2 --attn_implementation sdpa --bf16 false --max_steps 2
                 --output_dir "$SMOKE_DIR/out")
  MAX_LENGTH=2048
else
  : "${DATASET:?set DATASET to a hub dataset name or a local json/jsonl/parquet file of long documents}"
fi
