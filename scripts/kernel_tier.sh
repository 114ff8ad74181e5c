#!/usr/bin/env bash
# The GPU-kernel tier (docs/gpu-kernels-on-cpu.md): FLA's, Liger's and mamba_ssm's Triton kernels on CPU through
# Triton's interpreter, in its own environment .venv-triton (installed, FLA changes what transformers runs).
#
#   scripts/kernel_tier.sh [--record] [--install-log FILE]
#
# Builds .venv-triton when it is missing or was built from other pins (tests/interpreter/constraints.txt, setup.py;
# torch among the pins: nothing may upgrade it; mamba-ssm is a source build without CUDA), then runs the tier.
# --record: after a clean pass, writes tests/interpreter/recorded_pass.json (scripts/kernel_tier_record.py), which
# lets .ci/run skip the tier while the files it covers stay as they were; commit it with them. Run it after changing
# the package or the tier (3 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
record=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
install_log=$work/install.log
while [ $# -gt 0 ]; do
  case "$1" in
    --record) record=1 ;;
    --install-log) install_log=$2; shift ;;
    *) echo "usage: $0 [--record] [--install-log FILE]" >&2; exit 2 ;;
  esac
  shift
done
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
pins=$(cat tests/interpreter/constraints.txt setup.py | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv-triton/built-from 2> /dev/null)" != "$pins" ]; then
  rm -rf .venv-triton
  { python3 -m venv .venv-triton && . .venv-triton/bin/activate && pip install torch==2.13.0 &&
    pip install -c tests/interpreter/constraints.txt triton flash-linear-attention liger-kernel -e ".[test]" &&
    MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-deps --no-build-isolation \
      -c tests/interpreter/constraints.txt mamba-ssm && deactivate
  } > "$install_log" 2>&1 || { tail -40 "$install_log"; echo "kernel tier: .venv-triton failed to build"; exit 1; }
  echo "$pins" > .venv-triton/built-from
fi
python3 scripts/kernel_tier_record.py digests > "$work/before.json"
start=$(date +%s)
status=0
TRITON_INTERPRET=1 .venv-triton/bin/python -m pytest tests/interpreter -m triton_interpret -q -p no:cacheprovider \
  --durations=10 --junitxml="$work/junit.xml" || status=$?
if [ "$record" = 1 ]; then
  [ "$status" = 0 ] || { echo "kernel tier failed (exit $status): nothing recorded"; exit "$status"; }
  .venv-triton/bin/python scripts/kernel_tier_record.py result --junit "$work/junit.xml" \
    --seconds $(( $(date +%s) - start )) > "$work/result.json"
  python3 scripts/kernel_tier_record.py write --result "$work/result.json" --before "$work/before.json"
fi
exit "$status"
