#!/usr/bin/env bash
# Stop 19, call G: the device bank tests with the device synchronised after their pageable copies
# (a pageable cudaMemcpy may return before its DMA lands; the device's nullptr stream is its own
# non-blocking one), 30 times beside a GPU load (stop19_f: 14 of 150 failed, all in the
# host-staged kResolved flow); then shard 0 of the whole suite (the shard that failed in stop19_e).
set -u
source scripts/device/build.sh
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
F='Gpu/DeviceBankTest.*:DeviceBankResolve.*'
( for i in $(seq 1 40); do timeout 60 $T --gtest_filter='*CudaRuntime*:*CudaBank*:Gpu*Attention*' --gtest_brief=1 > /dev/null 2>&1; done ) &
L=$!
timeout 200 $T --gtest_filter="$F" --gtest_repeat=30 --gtest_brief=1 > $D/loaded.log 2>&1
echo "loaded rc=$? failed=$(grep -c '^\[  FAILED  \] Gpu' $D/loaded.log) passed_runs=$(grep -c '^\[  PASSED  \]' $D/loaded.log)"
kill $L 2>/dev/null; wait 2>/dev/null
GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=0 timeout 300 $T --gtest_brief=1 > $D/shard0.log 2>&1
echo "shard0 rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" $D/shard0.log | head
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
