#!/usr/bin/env bash
# Stop 16, call D: build; the GPU-memory cap tests and the decode step's suites on the final code.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests
timeout 60 $B/tests/kvferry_tests --gtest_brief=1 --gtest_filter='*GpuBytesCap*:*CudaRuntimeTest*:*CudaGraph*:*CudaPlannedStep*:*CudaStepBank*:*CudaPrefillStaged*' > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
cp $D/tests.log $OUT/; echo "total: $(( $(date +%s) - t0 )) s"
