#!/usr/bin/env bash
# The batched engine on the device machine, in one call: build libkdtree for sm_90a, install
# the pinned transformers wheel carried in .whl/, then the steps named (default: smoke tests
# bench). Logs under $OUT.
#   smoke   one short generate per mode (first failure printed whole)
#   tests   the GPU pytest files of the engine and of sampling
#   bench   tools/bench_engine_gpu.py with $BENCH_ARGS
#   memcheck compute-sanitizer memcheck on a short engine run
#   build   nothing more (the library and the wheel only)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdt-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(smoke tests bench)
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD/python
else
  export PYTHONPATH=$PWD/python
fi
export PYTHONUNBUFFERED=1
t0=$(date +%s)
if [ ! -f build-gpu/libkdtree.so ]; then
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a-real -DKDTREE_CUDA=ON \
    -DKDTREE_BUILD_TESTS=${KDT_NATIVE_TESTS:-OFF} > "$OUT/build.log" 2>&1 &&
  cmake --build build-gpu -j16 >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
export KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so
echo "build: $(( $(date +%s) - t0 )) s; transformers $(python3 -c 'import transformers; print(transformers.__version__)')"
for step in "${steps[@]}"; do
  case $step in
    smoke)
      python3 - <<'PY' 2>&1 | tee "$OUT/smoke.log" | tail -40
import time, traceback, torch
from pathlib import Path
from kdtree.apps.generate import load_pair
from kdtree.engine.batched import Engine
_, t, d = load_pair(Path("fixtures/models/stdlib-qwen3"), "cuda", "bfloat16")
prompts = [[5 + i, 17, 99, 300 + i] * (4 + i) for i in range(4)]
for mode, n in (("ar", 0), ("chain", 0), ("ddtree", 64)):
    try:
        e = Engine(t, d, mode=mode, budget=n, max_batch=4, max_length=512)
        e.capture_all()
        t0 = time.perf_counter(); outs = e.generate(prompts, 64); dt = time.perf_counter() - t0
        print(mode, n, "ok", e.stats.rounds, "rounds", f"{sum(len(o.tokens) for o in outs)/dt:.0f} tok/s",
              f"tau {e.stats.acceptance_length:.2f}", e.profile_round(4))
    except Exception:
        traceback.print_exc()
PY
      ;;
    tests)
      python3 -m pytest -q -x -rs tests_py/test_engine_batched.py $(ls tests_py/test_sampling_graph.py 2>/dev/null) \
        2>&1 | tee "$OUT/tests.log" | tail -30 ;;
    bench)
      python3 tools/bench_engine_gpu.py ${BENCH_ARGS:-} --out "$OUT/bench.json" --plot "$OUT/engine.png" \
        2>&1 | tee "$OUT/bench.log" | tail -80 ;;
    build) ;;
    memcheck)
      compute-sanitizer --tool memcheck --print-limit 20 python3 - <<'PY' 2>&1 | tee "$OUT/memcheck.log" | tail -20
import torch
from pathlib import Path
from kdtree.apps.generate import load_pair
from kdtree.engine.batched import Engine
_, t, d = load_pair(Path("fixtures/models/stdlib-qwen3"), "cuda", "bfloat16")
e = Engine(t, d, budget=32, max_batch=2, max_length=256, stop_tokens=[0])
e.capture_all()
outs = e.generate([[5, 17, 99, 300] * 5, [7, 8, 9]], 24)
print("memcheck run:", [len(o.tokens) for o in outs])
PY
      ;;
  esac
  echo "== $step done at $(( $(date +%s) - t0 )) s"
done
