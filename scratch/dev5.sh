set -u
tools/device_check.sh build || exit 1
(cd build-gpu && ctest -R "trees_cuda" 2>&1 | tail -2)
KDTREE_CUDA_TREES_DFS=1 KDT_CUDA_TREES=20000 build-gpu/test_trees_cuda 2>&1 | tail -1
echo "== bench: v4 breadth"; build-gpu/kdtree_bench_cuda
echo "== bench: v4 DFS"; KDTREE_CUDA_TREES_DFS=1 build-gpu/kdtree_bench_cuda
echo "== profile breadth"; build-gpu/kdtree_profile_trees_cuda
echo "== profile DFS"; KDTREE_CUDA_TREES_DFS=1 build-gpu/kdtree_profile_trees_cuda
