#!/usr/bin/env bash
# What the device machine runs for the CUDA work (see docs/perf-notes.md). Usage:
#   tools/device_check.sh [build|tests|forced|sanitize|python|profile|bench]...
# (no argument: all of them, in that order). Logs go to $OUT when set. SAN_TESTS (a glob or
# list of test programs) narrows the sanitize step.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdt-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build tests forced sanitize python profile bench)
for step in "${steps[@]}"; do
  case $step in
  build)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKDTREE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DKDTREE_BUILD_BENCHMARKS=ON \
      -DKDTREE_WERROR=ON > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
    cmake --build build-gpu -j 16 > "$OUT/build.log" 2>&1 || { grep -B2 -A8 -m5 "error" "$OUT/build.log"; exit 1; }
    echo "build: ok" ;;
  tests)
    (cd build-gpu && ctest --output-on-failure -j 4 --timeout 300) 2>&1 | tee "$OUT/ctest.log" | tail -25 ;;
  forced)
    echo "-- tree paths forced: heap (v2), descent (v4) and bisection (v3) at every budget, v1, inline masks,"
    echo "   v4 with one thread per chain owner, v4 depth first, v4 without the first-child walk, v4 without counting"
    KDTREE_CUDA_TREES_HEAP=1 KDT_CUDA_TREES=10000 timeout 300 build-gpu/test_trees_cuda 2>&1 | tail -1
    KDTREE_CUDA_TREES_PARALLEL=1 KDT_CUDA_TREES=20000 timeout 300 build-gpu/test_trees_cuda 2>&1 | tail -1
    KDTREE_CUDA_TREES_PARALLEL=1 KDTREE_CUDA_TREES_BISECT=1 KDT_CUDA_TREES=20000 timeout 300 build-gpu/test_trees_cuda 2>&1 | tail -1
    KDTREE_CUDA_TREES_V1=1 KDT_CUDA_TREES=3000 timeout 300 build-gpu/test_trees_cuda 2>&1 | tail -1
    KDTREE_CUDA_TREES_INLINE_MASKS=1 KDT_CUDA_TREES=10000 timeout 300 build-gpu/test_trees_cuda 2>&1 | tail -1
    KDTREE_CUDA_TREES_PARALLEL=1 KDTREE_CUDA_TREES_THREAD_CHAINS=1 KDT_CUDA_TREES=20000 timeout 300 build-gpu/test_trees_cuda 2>&1 | tail -1
    KDTREE_CUDA_TREES_DFS=1 KDT_CUDA_TREES=10000 timeout 300 build-gpu/test_trees_cuda 2>&1 | tail -1
    KDTREE_CUDA_TREES_PARALLEL=1 KDTREE_CUDA_TREES_NO_WALK=1 KDT_CUDA_TREES=20000 timeout 300 build-gpu/test_trees_cuda 2>&1 | tail -1
    KDTREE_CUDA_TREES_PARALLEL=1 KDTREE_CUDA_TREES_NO_COUNTING=1 KDT_CUDA_TREES=20000 timeout 300 build-gpu/test_trees_cuda 2>&1 | tail -1
    echo "-- verify from logits: one block per request, and clusters of 2 (the automatic choice covers 4 and 8)"
    KDTREE_CUDA_VERIFY_CLUSTER=1 timeout 300 build-gpu/test_verify_cuda 2>&1 | tail -1
    KDTREE_CUDA_VERIFY_CLUSTER=2 timeout 300 build-gpu/test_verify_cuda 2>&1 | tail -1
    echo "-- top-k: the chunk kernels for every k"
    KDTREE_CUDA_TOPK_CHUNKED=1 timeout 300 build-gpu/test_topk_cuda 2>&1 | tail -1 ;;
  sanitize)
    for tool in memcheck racecheck initcheck synccheck; do
      for t in ${SAN_TESTS:-build-gpu/test_*_cuda}; do
        KDT_CUDA_QUICK=1 KDT_CUDA_TREES=300 timeout ${SAN_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 9 "$t" \
          > "$OUT/san-$(basename "$t")-$tool.log" 2>&1
        rc=$?
        echo "$(basename "$t") $tool: exit $rc, $(grep -h 'SUMMARY' "$OUT/san-$(basename "$t")-$tool.log" | tail -1)"
      done
    done ;;
  python)
    KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so PYTHONPATH=python python3 -m pytest tests_py/test_gpu.py \
      tests_py/test_bindings.py -q -x -p no:cacheprovider 2>&1 | tail -15
    KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so PYTHONPATH=python python3 tools/readme_gpu_example.py && echo "README GPU example: ok" ;;
  profile)
    build-gpu/kdtree_profile_trees_cuda
    # The round's inputs (the GPU top-k of bench_gpu's bf16 drafter logits), N = 64, without
    # the repeated-id check, as build_trees_from_logits runs it (knob 1).
    echo "-- the round's inputs"
    KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so PYTHONPATH=python python3 tools/bench_gpu.py \
      --dump-topk /tmp/kdt-round-topk && KDT_PROF_KNOB=1 KDT_PROF_INPUT=/tmp/kdt-round-topk build-gpu/kdtree_profile_trees_cuda ;;
  bench)
    build-gpu/kdtree_bench_cuda 2>&1 | tee "$OUT/bench-trees.txt"
    build-gpu/kdtree_bench_stream 2>&1 | tee "$OUT/bench-stream.txt"
    KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so PYTHONPATH=python python3 tools/bench_gpu.py 2>&1 | tee "$OUT/bench-gpu.txt" ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
