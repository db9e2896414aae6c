#!/usr/bin/env bash
# Tensor parallelism on a machine of several GPUs (nvidia-h200-x2 / -x4), in one device call:
# build libkdtree (sm_90a); the TP benchmark at TP = 1, 2 and 4 (as many as the machine has;
# the table's columns, JSON per world size); then the multi-GPU and NCCL tests (the engine
# over NCCL against one GPU, the one-rank NCCL worlds, the sharded summaries).
# Usage: tools/device_tp.sh [shape] (default qwen3-8b). Logs and JSON go to $OUT.
# Needs torch with CUDA, the pinned transformers and accelerate (carry the wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/kdt-out}
SHAPE=${1:-qwen3-8b}
mkdir -p "$OUT"
START=$(date +%s)
say() { echo "[$(($(date +%s) - START)) s] $*"; }
export PYTHONPATH=$ROOT/python KDTREE_LIBRARY=$ROOT/build-gpu/libkdtree.so NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
GPUS=$(nvidia-smi -L | wc -l)
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKDTREE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
  -DKDTREE_WERROR=ON > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build build-gpu -j 16 > "$OUT/build.log" 2>&1 || { grep -B2 -A8 -m5 "error" "$OUT/build.log"; exit 1; }
say "build ok, $GPUS GPU(s)"
for T in 1 2 4; do
  [ "$T" -le "$GPUS" ] || continue
  torchrun --nproc-per-node "$T" tools/bench_engine_tp.py --shape "$SHAPE" --json "$OUT/tp$T.json" \
    > "$OUT/tp$T.txt" 2>&1
  say "TP $T: exit $?"; grep -v "^\[" "$OUT/tp$T.txt" | tail -20
done
python3 -m pytest tests_py/test_engine_batched_tp.py tests_py/test_topk_sharded.py -q -p no:cacheprovider -rs \
  -k "gpu" > "$OUT/pytest-tp.txt" 2>&1
tail -8 "$OUT/pytest-tp.txt"
say "pytest: $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest-tp.txt" | tail -1)"
