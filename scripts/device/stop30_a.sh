#!/usr/bin/env bash
# Stop 30, call A (written in stop 29 without device time left; the next session's first call).
# What stop 29 changed after its last device call: the asynchronous CPU part's job built once
# before the shadow-only scan, and the cost model's measured CPU rate (Stats::ms_cpu_attend_busy,
# cost_cpu_gbps_measured, in kvferry-e2e's rows). The lfps / CPU-part CUDA tests and memcheck;
# then lfps at 128K b1 (its rows now carry the probed and the measured CPU rate) and the scale
# table's 32K x 16 baselines under the 8 GiB cap (scripts/device/stop29_a.sh's modes). Results
# straight into $OUT/r, at most 8 files: the call's files beyond 8 do not come back.
set -u
D=$OUT/r
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='CudaCpuPart.*:LfpsDeviceScanRuntime.*:LfpsPrimeRuntime.*:LfpsScanTest.*:*CudaBankPressure*lfps*:*CudaEqualsHost/lfps*:CostModel.*'
timeout 90 $T --gtest_brief=1 --gtest_filter="$F" > $D/t.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure" $D/t.log | head -12
KVFERRY_TEST_NO_HOLD=1 timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 \
  $T --gtest_brief=1 --gtest_filter='CudaCpuPart.*' > $D/memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E "^\[  (PASSED|FAILED) |ERROR SUMMARY" $D/memcheck.log
rm -f $D/rows.jsonl
E="timeout 380 $B/bench/kvferry-e2e"
$E --modes lfps --contexts 131072 --batches 1 --steps 8 --json $D/lfps.jsonl > /dev/null 2>&1; echo "lfps rc=$?"
grep -o '"ms_per_token_step":[0-9.]*\|"cost_cpu_gbps[a-z_]*":[0-9.e+-]*' $D/lfps.jsonl
$E --modes kvpop_bank,psaw+kvpop_bank,xl+kvpop_bank,full_streaming,dense_cpu --contexts 32768 --batches 16 \
  --steps 4 --unique-kv --gpu-gib 8 --host-gib 110 --json $D/s32k16.jsonl > /dev/null 2>&1; echo "32k16 rc=$?"
grep -o '"mode":"[a-z_+]*"\|"ms_per_token_step":[0-9.]*' $D/s32k16.jsonl | paste - -
echo "total: $(( $(date +%s) - t0 )) s"
