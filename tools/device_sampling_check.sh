#!/usr/bin/env bash
# The GPU check of per-request sampled verification (kdt_verify_sample_batch_cuda), in one
# device call (a few minutes on an H200):
#   build     this tree with CUDA for sm_90a only (-DKDTREE_WERROR=ON): the library and the
#             native verify test; ptxas's register / spill report of native/cuda/verify_cuda.cu
#   native    test_verify_cuda (and its --verify-cluster 1 / 2 variants) through ctest
#   python    tests_py/test_sampling_graph.py and tests_py/test_gpu.py (torch with CUDA), then
#             the host tests tests_py/test_sampling.py against the same library
#   sanitize  compute-sanitizer memcheck over test_verify_cuda (KDT_CUDA_QUICK=1)
# Usage: tools/device_sampling_check.sh [build|native|python|sanitize]...  (no argument: all
# four, in that order). Logs go to $OUT (default /tmp/kdt-out); the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdt-out}
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build native python sanitize)
for step in "${steps[@]}"; do
  case $step in
  build)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
    if cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKDTREE_WERROR=ON -DKDTREE_CUDA=ON \
         -DCMAKE_CUDA_ARCHITECTURES=90a-real > "$OUT/configure.log" 2>&1 &&
       cmake --build "$BUILD" -j"$JOBS" --target kdtree test_verify_cuda > "$OUT/build.log" 2>&1; then
      note "build: OK"
    else
      note "build: FAILED (tail of $OUT/build.log:)"; tail -30 "$OUT/build.log" | tee -a "$SUMMARY"; exit 1
    fi
    nvcc -std=c++17 -arch=sm_90 -fmad=false -Xptxas -v -Iinclude -Inative -c native/cuda/verify_cuda.cu \
      -o "$OUT/verify_cuda.o" 2>&1 | grep -E "Compiling entry|registers|spill" > "$OUT/ptxas.txt"
    note "ptxas (sm_90): $(grep -c 'bytes spill stores' "$OUT/ptxas.txt") kernels, spilling: \
$(grep 'bytes spill' "$OUT/ptxas.txt" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads')"
    ;;
  native)
    if ctest --test-dir "$BUILD" -R '^test_verify_cuda' --output-on-failure > "$OUT/native.log" 2>&1; then
      note "native: OK ($(grep -h 'sample batch:' "$OUT/native.log" | head -1))"
    else
      note "native: FAILED (see $OUT/native.log)"; grep -E "FAIL|failed|Error" "$OUT/native.log" | head -30 | tee -a "$SUMMARY"
    fi
    ;;
  python)
    export PYTHONPATH=$PWD/python KDTREE_LIBRARY=$PWD/$BUILD/libkdtree.so
    if $PY -m pytest -q -rs tests_py/test_sampling_graph.py tests_py/test_gpu.py tests_py/test_sampling.py \
         > "$OUT/pytest.log" 2>&1; then
      note "python: OK ($(tail -1 "$OUT/pytest.log"))"
    else
      note "python: FAILED ($(tail -1 "$OUT/pytest.log"); see $OUT/pytest.log)"
      grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30 | tee -a "$SUMMARY"
    fi
    ;;
  sanitize)
    if KDT_CUDA_QUICK=1 compute-sanitizer --tool memcheck --error-exitcode 3 "$BUILD/test_verify_cuda" \
         > "$OUT/memcheck.log" 2>&1; then
      note "memcheck: OK ($(grep -h 'ERROR SUMMARY' "$OUT/memcheck.log"))"
    else
      note "memcheck: FAILED (see $OUT/memcheck.log)"; tail -30 "$OUT/memcheck.log" | tee -a "$SUMMARY"
    fi
    ;;
  *) note "unknown step $step"; exit 2 ;;
  esac
done
echo "---- summary"; cat "$SUMMARY"
