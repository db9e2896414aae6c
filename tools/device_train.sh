#!/usr/bin/env bash
# Train the demo pair on the device machine (tools/train_models.py) in stages that each fit
# one device call, e.g.
#   tools/device_train.sh corpus tokenizer target     # first call
#   tools/device_train.sh drafter eval                # a later call, carrying build-pair/
# The pair folder is $PAIR (default build-pair/, git-ignored: carry it to the next call);
# a copy of it comes back as $OUT/pair.tar.part-*. TRAIN_ARGS adds options (e.g. "--target-minutes 7").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdt-out}
PAIR=${PAIR:-build-pair}
mkdir -p "$OUT"
bash tools/device_engine.sh build || exit 1
export PYTHONPATH=/tmp/site:$PWD/python KDTREE_LIBRARY=$PWD/build-gpu/libkdtree.so PYTHONUNBUFFERED=1
stages=()
for s in "$@"; do stages+=(--stage "$s"); done
# TRAIN_TIMEOUT (seconds) bounds the training alone, so that the pair still comes back
timeout "${TRAIN_TIMEOUT:-3600}" python3 tools/train_models.py --out "$PAIR" --device cuda "${stages[@]}" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log" | tail -40
rc=${PIPESTATUS[0]}
# Files come back from the device at most 16 MiB each: the pair travels as a split tar,
# joined here by  cat pair.tar.part-* | tar xf - -C build-pair
tar cf - -C "$PAIR" . | split -b 15M - "$OUT/pair.tar.part-"
exit "$rc"
