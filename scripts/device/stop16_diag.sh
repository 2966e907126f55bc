#!/usr/bin/env bash
# Stop 16, first GPU call: build; where a dense all-resident decode step's time goes (nsys kernel
# durations and the gaps between them, ncu of one step kernel); racecheck of the LFPS prime kernel;
# the prime / prefill / graph tests (the PrHS wrappers' priming had not run on the GPU).
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
E=$B/bench/kvferry-e2e
PATH=$PATH:/usr/local/cuda/bin
if command -v nsys > /dev/null; then
  timeout 120 nsys profile -o $D/e2e --force-overwrite true $E --modes dense_resident --contexts 32768 --batches 1 --steps 8 --json $D/nsys_rows.jsonl > $D/nsys.log 2>&1
  timeout 60 nsys stats --report cuda_gpu_kern_sum,cuda_gpu_trace --format csv -o $D/stats $D/e2e.nsys-rep > $D/nsys_stats.log 2>&1
  rm -f $D/e2e.nsys-rep $D/e2e.sqlite
fi
echo "nsys: $(( $(date +%s) - t0 )) s"
if command -v ncu > /dev/null; then
  timeout 150 ncu --kernel-name regex:StepAttnKernel --launch-skip 70 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats $E --modes dense_resident --contexts 32768 --batches 1 --steps 4 > $D/ncu.txt 2>&1
fi
echo "ncu: $(( $(date +%s) - t0 )) s"
timeout 150 $B/tests/kvferry_tests --gtest_brief=1 --gtest_filter='LfpsPrime*:CudaPrefill*:CudaGraph*:*Wrapped*' > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -20
if command -v compute-sanitizer > /dev/null; then
  timeout 170 compute-sanitizer --tool racecheck --racecheck-report hazard $B/tests/kvferry_tests --gtest_brief=1 --gtest_filter='*LfpsPrimeTest.CudaKernelEqualsReference/0' > $D/race_prime.txt 2>&1; echo "racecheck rc=$?"
  tail -5 $D/race_prime.txt
fi
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
