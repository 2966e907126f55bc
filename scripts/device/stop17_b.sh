#!/usr/bin/env bash
# Stop 17, call B: build; the whole test suite in two shards side by side; memcheck and racecheck
# over the prefill tests of the copy-engine write-through (beside the shards).
set -u
source scripts/device/build.sh
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
CS=/usr/local/cuda/bin/compute-sanitizer
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 420 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
F='CudaPrefillOverlapOff.*:CudaPrefillStaged.ChunkMajor*'
timeout 400 $CS --tool memcheck --leak-check full --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$F" > $D/memcheck.log 2>&1 &
timeout 400 $CS --tool racecheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$F" > $D/racecheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck racecheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|RACECHECK SUMMARY|hazard" $D/$f.log | head -12
  tail -c 300 $D/$f.log | tail -2
done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
