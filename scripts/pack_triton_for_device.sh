#!/usr/bin/env bash
# Pack a Triton wheel small enough to carry to the lent GPU machine (its torch 2.11 pins Triton 3.6, under which
# flash-linear-attention 0.6 refuses GDN's backward on Hopper; the device tool carries at most 64 MiB). Strips the
# debug info of libtriton.so and drops what a CUDA run of FLA / Liger kernels doesn't load (the bundled CUDA tools:
# the device's own Triton 3.6 ptxas is used through TRITON_PTXAS_PATH; CUPTI, proton, the AMD backend and its
# entry point, test plugins). Output: .whl/triton<version>.tar.xz (~40 MB for 3.7.1). On the device:
#   T=$(python3 -c "import triton,os;print(os.path.dirname(triton.__file__))")   # before PYTHONPATH is set
#   tar -xJf .whl/triton*.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site TRITON_PTXAS_PATH=$T/backends/nvidia/bin/ptxas
set -euo pipefail
version="${1:-3.7.1}"
cd "$(dirname "$0")/.."
work=$(mktemp -d)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 "triton==${version}" -d "$work" -q
(cd "$work" && unzip -q triton-*.whl && rm triton-*.whl)
strip --strip-debug "$work/triton/_C/libtriton.so"
rm -rf "$work"/triton/backends/nvidia/bin "$work"/triton/backends/nvidia/lib/cupti "$work"/triton/_C/libproton.so \
  "$work"/triton/instrumentation "$work"/triton/plugins "$work"/triton/FileCheck "$work"/triton/backends/amd
sed -i '/amd/d' "$work"/triton-*.dist-info/entry_points.txt
mkdir -p .whl
(cd "$work" && tar -cf - triton triton-*.dist-info) | xz -9 -T2 > ".whl/triton${version}.tar.xz"
rm -rf "$work"
ls -l ".whl/triton${version}.tar.xz"
