set -u
tools/device_check.sh build || exit 1
tools/device_check.sh tests 2>&1 | tail -18
tools/device_check.sh forced
echo "== bench: v4 (default)"; build-gpu/kdtree_bench_cuda
echo "== bench: v3 (bisection)"; KDTREE_CUDA_TREES_BISECT=1 build-gpu/kdtree_bench_cuda
echo "== bench: heap"; KDTREE_CUDA_TREES_HEAP=1 build-gpu/kdtree_bench_cuda
echo "== profile v4"; build-gpu/kdtree_profile_trees_cuda
echo "== profile v4 forced parallel"; KDTREE_CUDA_TREES_PARALLEL=1 build-gpu/kdtree_profile_trees_cuda
KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so PYTHONPATH=python python3 tools/bench_gpu.py 2>&1 | tee $OUT/bench-gpu.txt | tail -40
