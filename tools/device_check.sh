#!/usr/bin/env bash
# One short device call that checks the serving and attention work: build libkdtree (sm_90a)
# with libkdtree_torch; the sharded merge's timings (every kernel variant) and the torch
# operators' host cost (C++ kernels, a captured round included); the C++ operators' error
# paths (faulthandler, gdb where installed); then the GPU tests of the merge, the
# operators, the tree attention, ragged rows, per-request limits, stop sequences, paged
# and one-byte compaction, and the batched engine's GPU tests, each file group under a
# time limit. Logs go to $OUT (default /tmp/kdt-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdt-out}
mkdir -p "$OUT"
START=$(date +%s)
say() { echo "[$(($(date +%s) - START)) s] $*"; }
pip install -q --no-deps .whl/*.whl > /dev/null 2>&1 || true
export PYTHONPATH=$PWD/python KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so KDTREE_TORCH_OPS=1
tools/device_serving.sh build 2>&1 | tail -3
python3 tools/bench_gpu.py --skip topk build round attention limits --repeats 100 > "$OUT/bench-merge.txt" 2>&1
grep -A14 "sharded top-k merge" "$OUT/bench-merge.txt"
python3 tools/bench_torch_ops.py --device cuda --no-compile > "$OUT/torch-ops.txt" 2>&1
tail -8 "$OUT/torch-ops.txt"
say "benchmarks done"
tools/device_serving.sh cpp-ops 2>&1 | tail -25
run_tests() {
  local limit=$1; shift
  timeout "$limit" python3 -m pytest "$@" -q -p no:cacheprovider -rs > "$OUT/pytest-$(basename "$1" .py).txt" 2>&1
  say "$*: exit $? ($(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest-$(basename "$1" .py).txt" | tail -1))"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest-$(basename "$1" .py).txt" | head -8
}
run_tests 100 tests_py/test_topk_sharded.py tests_py/test_ragged.py tests_py/test_request_limits.py \
  tests_py/test_stop_sequences.py tests_py/test_compact_paged.py tests_py/test_compact_bytes.py
run_tests 120 tests_py/test_tree_attention.py
run_tests 120 tests_py/test_engine_batched.py -k gpu
