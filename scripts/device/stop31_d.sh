#!/usr/bin/env bash
# Stop 31, call D: the whole suite in two shards on the final code (xl+ without the inner's
# ranking at its sharing layers; gpu/decode_select.cu otherwise as in stop 30).
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 280 $T --gtest_brief=1 > $D/d_shard$i.log 2>&1 &
done
wait
for f in d_shard0 d_shard1; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/$f.log | head -10
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" $D/$f.log > $D/$f.summary.txt
done
