#!/usr/bin/env bash
# Stop 20, call H: the whole test suite in two shards side by side, and memcheck over the device
# selection's tests (SparCas's dense compact scoring, the multi-CTA passes, Quest's parallel page
# walk) beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
CS=/usr/local/cuda/bin/compute-sanitizer
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 440 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
F='*SelectTopK*:CudaRuntimeLong*:*CudaStepBank*:*Sparcas*Cuda*:CudaRuntimeTest*'
timeout 420 $CS --tool memcheck --leak-check full --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$F" > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|LEAK SUMMARY" $D/$f.log | head -12
  tail -c 200 $D/$f.log | tail -1
done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
