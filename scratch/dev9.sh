set -u
tools/device_check.sh build || exit 1
(cd build-gpu && timeout 100 ctest -j 4 2>&1 | tail -3)
tools/device_check.sh forced
echo "== bench trees"; build-gpu/kdtree_bench_cuda
echo "== profile"; build-gpu/kdtree_profile_trees_cuda
for tool in racecheck memcheck; do
  KDT_CUDA_TREES=300 timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/test_trees_cuda > $OUT/san-$tool.log 2>&1
  echo "trees $tool: exit $?, $(grep -h 'ERROR SUMMARY' $OUT/san-$tool.log | tail -1)"
done
KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so PYTHONPATH=python timeout 80 python3 tools/bench_gpu.py > $OUT/bench-gpu.txt 2>&1; grep -A9 "## tree build" $OUT/bench-gpu.txt; grep -A4 "## whole round" $OUT/bench-gpu.txt
