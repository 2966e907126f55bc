#!/usr/bin/env bash
# For the next stop, first call: build; the whole test suite in two shards side by side (it
# covers GpuBytesCapCuda.PlanIsWhatTheGpuHolds with lfps's scan given way under a cap, written at
# stop 18 after its last GPU call); memcheck over the LFPS GPU scan's kernel and runtime tests
# beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
CS=/usr/local/cuda/bin/compute-sanitizer
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 420 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
F='*GpuLfpsScan*:LfpsPrimeRuntime.Cuda*:GpuBytesCapCuda.*'
timeout 400 $CS --tool memcheck --leak-check full --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$F" > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -12
  tail -c 300 $D/$f.log | tail -2
done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
