set -u
tools/device_check.sh build || exit 1
(cd build-gpu && ctest -R "trees_cuda|round_cuda" 2>&1 | tail -2)
tools/device_check.sh forced
KDTREE_CUDA_TREES_HASH1=1 KDT_CUDA_TREES=20000 build-gpu/test_trees_cuda 2>&1 | tail -1
echo "== bench: v4"; build-gpu/kdtree_bench_cuda
echo "== bench: v4, one hash row per round"; KDTREE_CUDA_TREES_HASH1=1 build-gpu/kdtree_bench_cuda
echo "== profile"; build-gpu/kdtree_profile_trees_cuda
echo "== profile hash1"; KDTREE_CUDA_TREES_HASH1=1 build-gpu/kdtree_profile_trees_cuda | grep -v block
for tool in racecheck memcheck; do
  KDT_CUDA_TREES=300 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/test_trees_cuda > $OUT/san-$tool.log 2>&1
  echo "trees $tool: exit $?, $(grep -h 'ERROR SUMMARY' $OUT/san-$tool.log | tail -1)"
done
KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so PYTHONPATH=python python3 tools/bench_gpu.py 2>&1 | tee $OUT/bench-gpu.txt | grep -A30 "## tree build"
