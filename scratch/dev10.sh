set -u
tools/device_check.sh build || exit 1
for tool in racecheck synccheck; do
  KDT_CUDA_TREES=300 timeout 70 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/test_trees_cuda > $OUT/san-$tool.log 2>&1
  echo "trees $tool: exit $?, $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/san-$tool.log | tail -1)"
done
timeout 60 build-gpu/test_trees_cuda 2>&1 | tail -1
KDTREE_CUDA_TREES_PARALLEL=1 KDT_CUDA_TREES=20000 timeout 30 build-gpu/test_trees_cuda 2>&1 | tail -1
build-gpu/kdtree_bench_cuda
