set -u
tools/device_check.sh build || exit 1
python3 -m pip install -q --no-deps --target /tmp/hf wheels/*.whl 2>&1 | tail -2 &
(cd build-gpu && ctest -j 4 2>&1 | tail -4)
tools/device_check.sh forced
echo "== bench trees"; build-gpu/kdtree_bench_cuda
echo "== profile"; build-gpu/kdtree_profile_trees_cuda
wait
export PYTHONPATH=/tmp/hf:python KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so
timeout 90 python3 tools/bench_gpu.py > $OUT/bench-gpu.txt 2>&1; tail -32 $OUT/bench-gpu.txt
timeout 200 python3 tools/bench_engine.py --device cuda --dtype bfloat16 --repeats 2 --json $OUT/engine-bf16.json 2>&1 | tee $OUT/engine-bf16.txt
timeout 60 python3 -m pytest tests_py/test_gpu.py tests_py/test_bindings.py tests_py/test_hf.py -q -x -p no:cacheprovider 2>&1 | tail -2
for tool in racecheck memcheck; do
  KDT_CUDA_TREES=300 timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/test_trees_cuda > $OUT/san-$tool.log 2>&1
  echo "trees $tool: exit $?, $(grep -h 'ERROR SUMMARY' $OUT/san-$tool.log | tail -1)"
done
