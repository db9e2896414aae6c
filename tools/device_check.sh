#!/usr/bin/env bash
# The GPU check of the CUDA code, in one device call (~9 minutes on an H200 with 16 cores):
#   build     this tree (sm_90 only, -DKDTREE_WERROR=ON) and, for the A/B, the old commit
#   bench     kdtree_bench_cuda (tree build, N = 64 / 256 / 1024), old and new alternated
#   tests     ctest -L cuda (the forced-path entries included), with the 100,012-tree
#             comparison of test_trees_cuda run on its own to show its summary line
#   forced    every forced path of the tree builder (native/kdt_testing.h) on more trees
#   sanitize  compute-sanitizer memcheck, racecheck, initcheck and synccheck over every GPU
#             test program (KDT_CUDA_QUICK=1), test_trees_cuda --forced included (40
#             trees a path)
# Usage: tools/device_check.sh [build|bench|tests|forced|sanitize|python]...  (no argument:
# the first five, in that order; python: the GPU pytest files, needs torch with CUDA).
# Logs go to $OUT (default /tmp/kdt-out); the summary is printed at the end.
# The A/B's old sources: $KDT_AB_OLD (a directory or a .tar/.tar.gz of the tree), else
# ab-old.tar.gz or build-gpu/ab-old.tar.gz in this tree, else `git archive $KDT_AB_COMMIT`
# (default a402334) where git history is there; otherwise the A/B is skipped, said so.
# Make the archive on a machine with the history:
#   git archive --format=tar.gz -o ab-old.tar.gz a402334
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/kdt-out}
mkdir -p "$OUT"
START=$(date +%s)
BUDGET_S=${BUDGET_S:-540}   # the whole call; the sanitizers get what is left
JOBS=${JOBS:-16}
AB_COMMIT=${KDT_AB_COMMIT:-a402334}
OLD_SRC=/tmp/kdt-ab-old
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(($(date +%s) - START)); }

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build bench tests forced sanitize)

have_old=0
prepare_old() {
  rm -rf "$OLD_SRC" && mkdir -p "$OLD_SRC"
  local src=${KDT_AB_OLD:-}
  if [ -z "$src" ]; then
    for f in ab-old.tar.gz build-gpu/ab-old.tar.gz; do [ -f "$f" ] && src=$f && break; done
  fi
  if [ -n "$src" ] && [ -d "$src" ]; then
    cp -r "$src"/. "$OLD_SRC"/ && have_old=1 && note "A/B: old sources from directory $src"
  elif [ -n "$src" ] && [ -f "$src" ]; then
    tar -xf "$src" -C "$OLD_SRC" && have_old=1 && note "A/B: old sources from archive $src"
  elif git rev-parse --verify -q "$AB_COMMIT^{commit}" > /dev/null 2>&1; then
    git archive "$AB_COMMIT" | tar -x -C "$OLD_SRC" && have_old=1 && note "A/B: old sources from git $AB_COMMIT"
  fi
  if [ $have_old -eq 0 ]; then
    note "A/B: SKIPPED (no git history for $AB_COMMIT here and no archive; make one with"
    note "     git archive --format=tar.gz -o ab-old.tar.gz $AB_COMMIT, and carry it)"
  fi
}

for step in "${steps[@]}"; do
  case $step in
  build)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
    prepare_old
    # Both trees configure and build at once (the old one only the library and the bench).
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKDTREE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real -DKDTREE_BUILD_BENCHMARKS=ON \
      -DKDTREE_WERROR=ON > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
    cmake --build build-gpu -j "$JOBS" > "$OUT/build.log" 2>&1 &
    new_pid=$!
    old_pid=
    if [ $have_old -eq 1 ]; then
      ( cmake -S "$OLD_SRC" -B "$OLD_SRC/build" -DCMAKE_BUILD_TYPE=Release -DKDTREE_CUDA=ON \
          -DCMAKE_CUDA_ARCHITECTURES=90-real > "$OUT/cmake-old.log" 2>&1 &&
        cmake --build "$OLD_SRC/build" --target kdtree_bench_cuda -j $((JOBS / 2)) > "$OUT/build-old.log" 2>&1 ) &
      old_pid=$!
    fi
    if ! wait $new_pid; then
      grep -B2 -A8 -m5 "error" "$OUT/build.log"
      note "build: FAILED (see build.log)"
      exit 1
    fi
    note "build: ok ($(elapsed) s)"
    if [ -n "$old_pid" ]; then
      if wait "$old_pid"; then note "build of $AB_COMMIT: ok"; else have_old=0; note "build of $AB_COMMIT: FAILED (A/B skipped)"; fi
    fi ;;
  bench)
    # Old and new alternated twice: the medians of each run, both printed.
    for rep in 1 2; do
      if [ $have_old -eq 1 ]; then
        "$OLD_SRC/build/kdtree_bench_cuda" > "$OUT/bench-old-$rep.txt" 2>&1
      fi
      build-gpu/kdtree_bench_cuda > "$OUT/bench-new-$rep.txt" 2>&1
    done
    note "bench (B = 64, L = 16; us; call / graph / stream):"
    for f in "$OUT"/bench-old-*.txt "$OUT"/bench-new-*.txt; do
      [ -f "$f" ] || continue
      awk -v tag="$(basename "$f" .txt)" '$1 ~ /^[0-9]+$/ {printf "  %-12s N=%-5s %8s %8s %8s\n", tag, $1, $2, $3, $4}' "$f" \
        | tee -a "$SUMMARY"
    done
    note "bench done ($(elapsed) s)" ;;
  tests)
    # The 100,012-tree comparison on its own (its summary line), the rest of ctest beside it.
    (timeout 300 build-gpu/test_trees_cuda > "$OUT/test_trees_cuda.txt" 2>&1; echo "exit $?" >> "$OUT/test_trees_cuda.txt") &
    trees_pid=$!
    (cd build-gpu && timeout 400 ctest -L cuda -E '^test_trees_cuda$' --output-on-failure -j 6 --timeout 300) \
      > "$OUT/ctest.log" 2>&1
    wait $trees_pid
    note "ctest -L cuda: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
    grep -E '^\s*[0-9]+/[0-9]+ Test' "$OUT/ctest.log" | awk '{print "  " $0}' | sed 's/  */ /g' >> "$SUMMARY"
    note "test_trees_cuda (automatic): $(grep 'cuda trees' "$OUT/test_trees_cuda.txt" | tail -1) [$(tail -1 "$OUT/test_trees_cuda.txt")]"
    note "tests done ($(elapsed) s)" ;;
  forced)
    # path:trees, four at a time.
    printf '%s\n' heap:10000 global-heap:3000 bisect:20000 thread-chains:20000 no-walk:20000 no-counting:20000 \
      thread-chains,no-walk,no-counting:10000 inline-masks:10000 bisect,no-counting:10000 deep:5000 \
      | xargs -P 4 -I{} bash -c 'p=${1%%:*}; n=${1##*:}; timeout 240 build-gpu/test_trees_cuda --paths "$p" --trees "$n" \
          > "$2/forced-${p//,/+}.txt" 2>&1; echo "exit $?" >> "$2/forced-${p//,/+}.txt"' _ {} "$OUT"
    for f in "$OUT"/forced-*.txt; do
      note "forced $(grep 'cuda trees' "$f" | tail -1 | sed 's/^cuda trees //') [$(tail -1 "$f")]"
    done
    note "forced done ($(elapsed) s)" ;;
  sanitize)
    # Every GPU test program under every tool, SAN_PAR at a time, each job's timeout such
    # that the whole step fits in what is left of BUDGET_S.
    par=${SAN_PAR:-14}
    jobs_file=$OUT/san-jobs.txt
    : > "$jobs_file"
    for tool in racecheck memcheck initcheck synccheck; do
      for t in build-gpu/test_*_cuda; do echo "$tool $(basename "$t")" >> "$jobs_file"; done
      echo "$tool test_trees_cuda --forced" >> "$jobs_file"
    done
    njobs=$(wc -l < "$jobs_file")
    waves=$(((njobs + par - 1) / par))
    left=$((BUDGET_S - $(elapsed) - 15))
    per=$((left / waves))
    [ $per -gt 240 ] && per=240
    [ $per -lt 30 ] && per=30
    export OUT per
    xargs -P "$par" -L 1 bash -c 'tool=$1; shift; name=$(echo "$*" | tr " " "_" | tr -d -); log="$OUT/san-$name-$tool.log";
      trees=; case "$*" in *--forced*) trees=${SAN_FORCED_TREES:-40} ;; esac;
      KDT_CUDA_QUICK=1 KDT_CUDA_TREES=$trees timeout "$per" compute-sanitizer --tool "$tool" --error-exitcode 9 "build-gpu/$@" > "$log" 2>&1;
      rc=$?; echo "$tool $* : exit $rc, $(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$log" | tail -1)" > "$log.sum"' _ \
      < "$jobs_file"
    note "compute-sanitizer (KDT_CUDA_QUICK=1, ${per} s each; exit 0 clean, 9 errors, 124 timed out):"
    cat "$OUT"/san-*.log.sum | sort | awk '{print "  " $0}' | tee -a "$SUMMARY"
    note "sanitize done ($(elapsed) s)" ;;
  python)
    # The GPU pytest files, and the host ones whose results the GPU paths must match.
    KDTREE_LIBRARY=$ROOT/build-gpu/libkdtree.so PYTHONPATH=python python3 -m pytest tests_py/test_gpu.py \
      tests_py/test_bindings.py tests_py/test_topk_extremes.py tests_py/test_conventions.py \
      tests_py/test_request_limits.py tests_py/test_ragged.py tests_py/test_topk_sharded.py \
      tests_py/test_stop_sequences.py tests_py/test_compact_bytes.py tests_py/test_compact_paged.py \
      -q -p no:cacheprovider \
      2>&1 | tee "$OUT/pytest.txt" | tail -15
    note "pytest (GPU build): $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest.txt" | tail -1)" ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo
echo "==== summary ($(elapsed) s) ===="
cat "$SUMMARY"
