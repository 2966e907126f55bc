#!/usr/bin/env bash
# Stop 29, call E (the session's last device time): the asynchronous CPU part now hands over
# before the caller enqueues LFPS's deferred scan and the resident step (so the part's Selects
# start at once, as the serial path's "beside" launch did). The lfps and CPU-part CUDA tests;
# then lfps at 128K b1, async 1 / 0 x engine 0 / 300 us, the async run with 300 us traced (one
# step, Chrome trace JSON). Results straight into $OUT/r (they come back even if cut short).
set -u
D=$OUT/r
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='CudaCpuPart.*:LfpsDeviceScanRuntime.*:LfpsPrimeRuntime.*:LfpsScanTest.*:*CudaBankPressure*lfps*:*CudaEqualsHost/lfps*'
timeout 90 $T --gtest_brief=1 --gtest_filter="$F" > $D/t.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|FAILED" $D/t.log | head -12
rm -f $D/rows.jsonl
kvf_e2e e_async1_e300 -- --modes lfps --contexts 131072 --batches 1 --steps 8 --async-cpu 1 --engine-us 300 --trace $D/trace
kvf_e2e e_async0_e300 -- --modes lfps --contexts 131072 --batches 1 --steps 8 --async-cpu 0 --engine-us 300
kvf_e2e e_async1_e0 -- --modes lfps --contexts 131072 --batches 1 --steps 8 --async-cpu 1
kvf_e2e e_async0_e0 -- --modes lfps --contexts 131072 --batches 1 --steps 8 --async-cpu 0
grep -o '"variant":"[a-z0-9_]*"\|"ms_per_token_step":[0-9.]*\|"ms_in_decode_per_step":[0-9.]*' $D/rows.jsonl | paste - - - 
ls -la $D/trace* 2>/dev/null
echo "total: $(( $(date +%s) - t0 )) s"
