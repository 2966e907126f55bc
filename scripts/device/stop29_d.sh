#!/usr/bin/env bash
# Stop 29, call D: CudaCpuPart.* plainly and under memcheck. Under the sanitizer a launch returns
# once its kernel ran, so Decode returns only after the CPU part there: the memcheck run drops the
# test's hold (KVFERRY_TEST_NO_HOLD=1; the first D call saw the hold time out under memcheck).
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
timeout 60 $T --gtest_filter='CudaCpuPart.*:*CudaEqualsHost*lfps*' > $D/t.log 2>&1
echo "test rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Actual|Expected|rror" $D/t.log | head -20
KVFERRY_TEST_NO_HOLD=1 timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter='CudaCpuPart.*' > $D/memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E "^\[  (PASSED|FAILED) |Failure|Actual|ERROR SUMMARY" $D/memcheck.log
