#!/usr/bin/env bash
# Continue training the shipped pair's drafter on the device machine, in one call: install
# the pinned transformers wheel carried in .whl/, copy fixtures/models/stdlib-qwen3 to
# build-pair/, list the corpus again (tools/train_models.py --stage corpus: the device's own
# packages, the same files as the pair's), continue the drafter for MINUTES with the
# train_models.py options given after it, evaluate it (eval and repeats stages, with
# libkdtree built for sm_90), and leave $OUT/pair.tgz (drafter/, training.json,
# README.md) to unpack over fixtures/models/stdlib-qwen3. Each step is cut by `timeout`
# so that the archive is written within a 600 s call; a drafter stopped early is still its
# best checkpoint.
#   bash tools/device_pair.sh MINUTES [train_models.py drafter options]
#   e.g. bash tools/device_pair.sh 5 --seed 3 --self-rows 0.875 --self-anchors 0.875 --drafter-lr 6e-4
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdt-out}
mkdir -p "$OUT"
minutes=${1:?usage: device_pair.sh MINUTES [options]}
shift
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
bash tools/device_engine.sh build > "$OUT/build-step.log" 2>&1 || { tail -20 "$OUT/build-step.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/python KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so PYTHONUNBUFFERED=1
rm -rf build-pair && mkdir -p build-pair
src=fixtures/models/stdlib-qwen3
cp -r "$src/target" "$src/drafter" "$src/tokenizer.json" "$src/training.json" build-pair/
python3 tools/train_models.py --out /tmp/kdt-corpus --stage corpus > "$OUT/corpus.log" 2>&1 || { tail "$OUT/corpus.log"; exit 1; }
cp /tmp/kdt-corpus/corpus.json build-pair/
echo "setup: $(( $(date +%s) - t0 )) s; $(tail -2 "$OUT/corpus.log" | head -1)"
timeout "$(left 480)" python3 tools/train_models.py --out build-pair --device cuda --stage drafter \
  --drafter-layers 3 --drafter-init build-pair/drafter --drafter-minutes "$minutes" "$@" > "$OUT/train.log" 2>&1
echo "drafter: exit $?; $(grep -v '^drafter step\|^\[transformers\]' "$OUT/train.log" | tail -3)"
grep '^drafter step' "$OUT/train.log" | tail -4
timeout "$(left 585)" python3 tools/train_models.py --out build-pair --device cuda --stage eval --stage repeats \
  --drafter-layers 3 --drafter-minutes "$minutes" "$@" > "$OUT/eval.log" 2>&1
echo "eval: exit $?"
grep -v '^\[transformers\]' "$OUT/eval.log" | tail -8
tar czf "$OUT/pair.tgz" -C build-pair drafter training.json $( [ -f build-pair/README.md ] && echo README.md )
echo "total $(( $(date +%s) - t0 )) s"
