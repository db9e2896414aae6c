set -u
tools/device_check.sh build || exit 1
(cd build-gpu && ctest -R "trees_cuda|round_cuda" 2>&1 | tail -3)
tools/device_check.sh forced
echo "== bench: v4 (default)"; build-gpu/kdtree_bench_cuda
echo "== bench: v3 (bisection)"; KDTREE_CUDA_TREES_BISECT=1 build-gpu/kdtree_bench_cuda
echo "== profile"; build-gpu/kdtree_profile_trees_cuda
