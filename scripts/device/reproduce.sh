#!/usr/bin/env bash
# Copyright kvferry authors. Apache-2.0.
# On the GPU machine: python3 bench/reproduce.py NAME (build, run with its baselines, write
# bench/results/NAME.json with provenance), then copy the file and the plots to $OUT.
#   bash scripts/device/reproduce.sh NAME [--no-build]     (names: python3 bench/reproduce.py --list)
#   B: build folder (default /tmp/b); T: scratch folder; KVFERRY_SOURCE_COMMIT: the commit the copied
#   tree is (set it from the development machine: the copy's git HEAD is not that commit).
set -u
name=${1:?usage: reproduce.sh NAME [--no-build]}
export B=${B:-/tmp/b}
OUT=${OUT:-/tmp/reproduce}
mkdir -p "$OUT"
t0=$(date +%s)
python3 bench/reproduce.py "$@"
rc=$?
cp -f bench/results/${name}*.json "$OUT"/ 2>/dev/null
python3 bench/plot.py --results bench/results > /dev/null 2>&1 && cp -f bench/results/*.png "$OUT"/ 2>/dev/null
echo "total: $(( $(date +%s) - t0 )) s, rc=$rc"
exit $rc
