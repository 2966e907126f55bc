#!/usr/bin/env bash
# Stop 43, call A: stop 42's cross-layer prefetch (xl+ with the device bank: PrefetchListRows on
# the admissions' stream, StepBankView::staged) and the rollback mend (fd19d14) on the GPU: the
# prefetch's tests (rule on random lists, CUDA twin without it, faults), the split, planned-step,
# graph, bank, long-runtime and CudaEqualsHost suites around them; memcheck over the prefetch.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='PrefetchListRows.*:CudaStepBank.*:HostListBank.*:*FaultsXlPrefetch*:*FaultsSplit*:*FaultsBank*:SplitStepList.*:SchedulerSplit.*:CostModel.*:PlannedStep.*:*DeviceSelected*:AsyncCpuPart.*:*CudaGraph*:*CudaRuntimeLong*:*CudaEqualsHost/*'
timeout 300 $T --gtest_brief=1 --gtest_filter="$F" > $D/a_t.log 2>&1
echo "== a_t rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/a_t.log | head -16
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" $D/a_t.log > $D/a_t.summary.txt
timeout 150 compute-sanitizer --tool memcheck $T --gtest_brief=1 \
  --gtest_filter='PrefetchListRows.*:CudaStepBank.XlPrefetch*:*FaultsXlPrefetch/*decode_before_cuda*' > $D/a_memcheck.log 2>&1
echo "== memcheck rc=$?"; grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) " $D/a_memcheck.log | tee $D/a_memcheck.summary.txt
