#!/usr/bin/env bash
# Stop 26, call C: the whole suite in two shards on the final code (HiP lag 1 and dense_bits 4 the
# defaults), with memcheck over the hip CUDA tests beside it (untimed: the shards share the GPU).
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 330 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
timeout 330 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 \
  --gtest_filter='*CudaEqualsHost/hip*:*CudaEqualsHost/psaw_hip*:*CudaRuntimeLong.MultiCtaSelectionEqualsHost/2:*CudaGraph*hip*' > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -12
done
