#!/usr/bin/env bash
# Stop 19, call F: DeviceBankTest.*/hash_full_map failed once in stop19_e's shard 0 (step 20,
# the host-staged kResolved flow, outputs off) and passed in stop19_a's: is it flaky? The suite
# alone 30 times; then 30 times beside a GPU load (the CUDA runtime tests in a loop).
set -u
source scripts/device/build.sh
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
F='Gpu/DeviceBankTest.*:DeviceBankResolve.*'
timeout 150 $T --gtest_filter="$F" --gtest_repeat=30 --gtest_brief=1 > $D/alone.log 2>&1
echo "alone rc=$? failed=$(grep -c '^\[  FAILED  \] Gpu' $D/alone.log) passed_runs=$(grep -c '^\[  PASSED  \]' $D/alone.log)"
( for i in $(seq 1 40); do timeout 60 $T --gtest_filter='*CudaRuntime*:*CudaBank*:Gpu*Attention*' --gtest_brief=1 > /dev/null 2>&1; done ) &
L=$!
timeout 200 $T --gtest_filter="$F" --gtest_repeat=30 --gtest_brief=1 > $D/loaded.log 2>&1
echo "loaded rc=$? failed=$(grep -c '^\[  FAILED  \] Gpu' $D/loaded.log) passed_runs=$(grep -c '^\[  PASSED  \]' $D/loaded.log)"
kill $L 2>/dev/null; wait 2>/dev/null
grep -E "^\[  FAILED  \]|Failure" $D/alone.log $D/loaded.log | sort | uniq -c | head -20
grep -B2 -A3 "Failure" $D/loaded.log $D/alone.log | head -40
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
