#!/usr/bin/env bash
# What the device machine runs for the CUDA work (see docs/perf-notes.md): build for sm_90,
# every native test (cpu and cuda labels), compute-sanitizer on the GPU tree test, the
# GPU tree benchmark. Logs go to $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdt-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKDTREE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DKDTREE_WERROR=ON > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build build-gpu -j 16 > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
(cd build-gpu && ctest --output-on-failure) 2>&1 | tee "$OUT/ctest.log" | tail -15
echo "-- version 1 kernel (global memory), forced:"
KDTREE_CUDA_TREES_V1=1 KDT_CUDA_TREES=3000 build-gpu/test_trees_cuda 2>&1 | tail -2
echo "-- version 2 (shared-memory heap), forced:"
KDTREE_CUDA_TREES_HEAP=1 KDT_CUDA_TREES=20000 build-gpu/test_trees_cuda 2>&1 | tail -2
echo "-- version 3 (parallel) forced at every budget:"
KDTREE_CUDA_TREES_PARALLEL=1 KDT_CUDA_TREES=30000 build-gpu/test_trees_cuda 2>&1 | tail -2
echo "-- default kernel selection (version 3 from N = 128, heap below and as fallback):"
build-gpu/test_trees_cuda 2>&1 | tail -2
for tool in memcheck racecheck initcheck synccheck; do
  KDT_CUDA_TREES=1500 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/test_trees_cuda \
    > "$OUT/sanitizer-$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer-$tool.log") clean summary line)"
  tail -2 "$OUT/sanitizer-$tool.log"
done
echo "-- bench (default kernel):"
build-gpu/kdtree_bench_cuda 2>&1 | tee "$OUT/bench.txt"
echo "-- bench (version 2 heap):"
KDTREE_CUDA_TREES_HEAP=1 build-gpu/kdtree_bench_cuda 2>&1 | tee "$OUT/bench-v2.txt"
