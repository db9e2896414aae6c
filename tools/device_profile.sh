#!/usr/bin/env bash
# Profiles the GPU tree builder on the device machine: ncu's source-level stall samples for
# one launch of each path at N = 64 and N = 1024 (B = 64, L = 16). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdt-out}
mkdir -p "$OUT"
[ -x build-gpu/kdtree_bench_cuda ] || {
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKDTREE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real -DKDTREE_BUILD_BENCHMARKS=ON > "$OUT/cmake.log" 2>&1
  cmake --build build-gpu -j 16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
}
# parallel: the automatic dispatch; heap: the one-thread heap forced (native/kdt_testing.h).
for variant in parallel heap; do
  args=(); [ "$variant" = heap ] && args=(--paths heap)
  for skip in 3 69; do   # the bench's 4th launch of N=64 (skip 3) and of N=1024 (skip 3 + 33 + 33)
    ncu --clock-control none --kernel-name regex:build_kernel --launch-skip $skip --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section LaunchStats \
      build-gpu/kdtree_bench_cuda "${args[@]}" > "$OUT/ncu-$variant-$skip.txt" 2>&1
    echo "== $variant skip $skip"
    grep -E "Duration|Warp Cycles Per Issued|Stall|Block Size|Dynamic Shared" "$OUT/ncu-$variant-$skip.txt" | head -12
  done
done
