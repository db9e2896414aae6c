#!/usr/bin/env bash
# The serving features' GPU side in one device call (per-request budgets, ragged rows, the
# sharded top-k merge, stop sequences, one-byte compaction): build libkdtree (sm_90a) with
# its CUDA tests; benchmarks first (bench_gpu's merge and per-request budget sections, the
# torch operators' host cost); the
# CUDA C tests; the GPU pytest files; compute-sanitizer memcheck and racecheck over the
# Python GPU tests of the new kernels.
# Usage: tools/device_serving.sh [build] [bench] [ctest] [pytest] [sanitize] [profile] [cpp-ops]
#   (default: all but profile and cpp-ops)
# Logs go to $OUT (default /tmp/kdt-out). Needs torch with CUDA and the pinned transformers
# (carry the wheels: pip install --no-deps .whl/*.whl).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/kdt-out}
mkdir -p "$OUT"
START=$(date +%s)
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build bench ctest pytest sanitize)
say() { echo "[$(($(date +%s) - START)) s] $*"; }
export PYTHONPATH=$ROOT/python KDTREE_LIBRARY=$ROOT/build-gpu/libkdtree.so KDTREE_TORCH_OPS=1
GPU_TESTS=(tests_py/test_request_limits.py tests_py/test_ragged.py tests_py/test_topk_sharded.py
           tests_py/test_stop_sequences.py tests_py/test_compact_bytes.py tests_py/test_compact_paged.py
           tests_py/test_gpu.py tests_py/test_torch_ops.py)
for step in "${steps[@]}"; do
  case $step in
  build)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKDTREE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
      -DKDTREE_WERROR=ON -DKDTREE_TORCH_OPS=ON -DPython3_EXECUTABLE="$(command -v python3)" \
      > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
    cmake --build build-gpu -j 16 > "$OUT/build.log" 2>&1 || { grep -B2 -A8 -m5 "error" "$OUT/build.log"; exit 1; }
    say "build ok" ;;
  bench)
    python3 tools/bench_gpu.py --skip topk build round attention --repeats 100 2>&1 | tee "$OUT/bench.txt"
    python3 tools/bench_torch_ops.py --device cuda --json "$OUT/torch-ops-cuda.json" 2>&1 | tee "$OUT/torch-ops.txt"
    # the same with the operators' Python CUDA kernels (libkdtree_torch not loaded)
    KDTREE_TORCH_OPS=0 python3 tools/bench_torch_ops.py --device cuda --no-compile 2>&1 | tee -a "$OUT/torch-ops.txt"
    python3 tools/bench_torch_ops.py --device cpu --no-compile 2>&1 | tee -a "$OUT/torch-ops.txt"
    say "bench done" ;;
  ctest)
    ctest --test-dir build-gpu -L cuda --output-on-failure > "$OUT/ctest.txt" 2>&1
    say "ctest: $(grep -E 'tests passed|tests failed' "$OUT/ctest.txt" | tail -1)" ;;
  pytest)
    python3 -m pytest "${GPU_TESTS[@]}" -q -p no:cacheprovider -rs > "$OUT/pytest.txt" 2>&1
    # the torch operators' Python CUDA kernels too
    KDTREE_TORCH_OPS=0 python3 -m pytest tests_py/test_torch_ops.py -q -p no:cacheprovider -rs >> "$OUT/pytest.txt" 2>&1
    # the engines' GPU tests alone (their CPU tests are CI's)
    python3 -m pytest tests_py/test_engine_batched.py tests_py/test_engine_batched_tp.py \
      tests_py/test_distributed_verify.py -k gpu -q \
      -p no:cacheprovider -rs >> "$OUT/pytest.txt" 2>&1
    tail -15 "$OUT/pytest.txt"
    say "pytest: $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest.txt" | tail -1)" ;;
  sanitize)
    for tool in memcheck racecheck; do
      compute-sanitizer --tool "$tool" --error-exitcode 9 --target-processes all \
        python3 -m pytest tests_py/test_ragged.py tests_py/test_topk_sharded.py tests_py/test_stop_sequences.py \
        tests_py/test_request_limits.py -q -p no:cacheprovider -k "gpu" > "$OUT/sanitize-$tool.txt" 2>&1
      say "$tool: exit $? ($(grep -E 'ERROR SUMMARY' "$OUT/sanitize-$tool.txt" | tail -1))"
    done ;;
  profile)
    # where the sharded merge's warp kernel and the shard statistics kernel spend their time
    # (the merge's goal is < 10 us; 18.9 us on an H200, c3ab3b8): ncu's summary and stall
    # reasons for one launch of each, from bench_gpu's merge section
    for kernel in merge_paths_kernel shard_stats_kernel; do
      ncu --clock-control none --kernel-name "regex:$kernel" --launch-count 1 --set full \
        python3 tools/bench_gpu.py --skip topk build round attention limits --repeats 3 \
        > "$OUT/ncu-$kernel.txt" 2>&1
      grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Achieved Occupancy|Stall [A-Z]" \
        "$OUT/ncu-$kernel.txt" | head -16
    done ;;
  cpp-ops)
    # the torch operators' tests with the C++ kernels, under faulthandler and then under gdb
    # where it is installed (a C++ raise after the kernels crashed the process on 2026-12-05,
    # 9d4c2df; since 756e857 only the *_status operators have C++ kernels): $OUT/cpp-ops.txt
    python3 -X faulthandler -m pytest tests_py/test_torch_ops.py -q -p no:cacheprovider -rs > "$OUT/cpp-ops.txt" 2>&1
    say "C++ operator tests: exit $? ($(grep -E '[0-9]+ (passed|failed)' "$OUT/cpp-ops.txt" | tail -1))"
    if command -v gdb > /dev/null; then
      gdb -batch -ex run -ex bt --args python3 -m pytest tests_py/test_torch_ops.py -q -p no:cacheprovider \
        -k errors >> "$OUT/cpp-ops.txt" 2>&1
      grep -E "^#[0-9]+ " "$OUT/cpp-ops.txt" | head -30
    fi ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
