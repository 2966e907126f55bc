#!/usr/bin/env bash
# Stop 17, call J: the final code's CUDA runtime and graph suites (psaw+ cases included), memcheck
# and racecheck over the psaw+ cases.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
CS=/usr/local/cuda/bin/compute-sanitizer
timeout 200 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeTest*:*CudaGraph*:*DeviceSelected*:Prhs*:*GpuBytesCap*' > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
F='*CudaRuntimeTest*psaw*:*CudaGraph*psaw*'
timeout 150 $CS --tool memcheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$F" > $D/memcheck.log 2>&1 &
timeout 150 $CS --tool racecheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$F" > $D/racecheck.log 2>&1 &
wait
for f in memcheck racecheck; do echo "== $f"; grep -E "^\[  (PASSED|FAILED) |^\[==========\]|ERROR SUMMARY|RACECHECK SUMMARY" $D/$f.log | head -5; done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
