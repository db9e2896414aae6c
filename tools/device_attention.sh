#!/usr/bin/env bash
# The tree-attention kernel on the device, in one call: build this tree's libkdtree
# (sm_90a) and, for the A/B, an older one (sm_90); benchmark both (tools/bench_tree_attention.py,
# the old one without baselines); the float64-reference tests; optionally the sanitizers.
# Usage: tools/device_attention.sh [build] [bench] [tests] [sanitize] [engine]
#   old sources: $KDT_AB_OLD (a .tar.gz of the older tree; default build-gpu/ab-old.tar.gz,
#   made with `git archive --format=tar.gz -o build-gpu/ab-old.tar.gz <commit>`).
# Logs and JSON go to $OUT (default /tmp/kdt-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdt-out}
mkdir -p "$OUT"
START=$(date +%s)
OLD_TAR=${KDT_AB_OLD:-build-gpu/ab-old.tar.gz}
OLD=/tmp/kdt-att-old
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build bench tests)
say() { echo "[$(($(date +%s) - START)) s] $*"; }
export PYTHONPATH=$PWD/python
for step in "${steps[@]}"; do
  case $step in
  build)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKDTREE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
      -DKDTREE_WERROR=ON > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
    cmake --build build-gpu -j 12 --target kdtree > "$OUT/build.log" 2>&1 &
    new_pid=$!
    old_pid=
    if [ -f "$OLD_TAR" ]; then
      rm -rf "$OLD" && mkdir -p "$OLD" && tar -xzf "$OLD_TAR" -C "$OLD"
      ( cmake -S "$OLD" -B "$OLD/build" -DCMAKE_BUILD_TYPE=Release -DKDTREE_CUDA=ON \
          -DCMAKE_CUDA_ARCHITECTURES=90-real > "$OUT/cmake-old.log" 2>&1 &&
        cmake --build "$OLD/build" --target kdtree -j 4 > "$OUT/build-old.log" 2>&1 ) &
      old_pid=$!
    fi
    wait $new_pid || { grep -B2 -A8 -m5 "error" "$OUT/build.log"; say "build FAILED"; exit 1; }
    grep -A2 "attention_kernel" "$OUT/build.log" | grep -m6 "spill\|Used" || true
    say "build ok"
    if [ -n "$old_pid" ]; then wait "$old_pid" && say "old build ok" || say "old build FAILED"; fi ;;
  bench)
    KDTREE_LIBRARY=build-gpu/libkdtree.so python tools/bench_tree_attention.py --out "$OUT/attention-new.json" ${BENCH_ARGS:-}
    if [ -f "$OLD/build/libkdtree.so" ]; then
      say "old:"
      KDTREE_LIBRARY=$OLD/build/libkdtree.so python tools/bench_tree_attention.py --no-baselines \
        --out "$OUT/attention-old.json" ${BENCH_ARGS:-}
    fi
    say "bench done" ;;
  tests)
    KDTREE_LIBRARY=build-gpu/libkdtree.so python -m pytest -q -x tests_py/test_tree_attention.py 2>&1 | tail -15
    say "tests done" ;;
  engine)
    pip install -q --no-deps .whl/transformers-*.whl 2>/dev/null || true
    KDTREE_LIBRARY=build-gpu/libkdtree.so python -m pytest -q tests_py/test_engine_batched.py tests_py/test_gpu.py 2>&1 | tail -8
    say "engine tests done" ;;
  sanitize)
    for tool in memcheck racecheck initcheck; do
      KDT_SANITIZE=1 KDTREE_LIBRARY=build-gpu/libkdtree.so timeout 200 compute-sanitizer --tool $tool \
        --target-processes all python -m pytest -q -x tests_py/test_tree_attention.py -k "not long" \
        > "$OUT/sanitize-$tool.txt" 2>&1
      say "$tool: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitize-$tool.txt" | tail -2 | tr '\n' ' ')"
    done ;;
  esac
done
