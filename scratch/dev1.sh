set -u
tools/device_check.sh build || exit 1
python3 -m pip install -q --no-deps --target /tmp/hf wheels/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/hf:python KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so
python3 -c "import matplotlib" 2>/dev/null && PLOT="--plot $OUT/round.png" || { echo "no matplotlib"; PLOT=""; }
python3 -m pytest tests_py/test_hf.py -q -p no:cacheprovider -k cuda 2>&1 | tail -5
python3 tools/bench_engine.py --device cuda --dtype bfloat16 --json $OUT/engine-bf16.json 2>&1 | tee $OUT/engine-bf16.txt
python3 tools/bench_engine.py --device cuda --dtype float32 --budgets 16 64 256 --json $OUT/engine-f32.json 2>&1 | tee $OUT/engine-f32.txt
python3 -m kdtree generate --device cuda --dtype bfloat16 --budget 64 $PLOT 2>&1 | tail -40 > $OUT/generate.txt
tail -8 $OUT/generate.txt
