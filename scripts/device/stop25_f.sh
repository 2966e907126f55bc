#!/usr/bin/env bash
# Stop 25, call F: the sanitizers over the long HiP tests, which the earlier filters missed
# (CudaRuntimeLong's instances are named by index: hip is /2): memcheck over the long runtime
# (2964 nodes, 5928 branches an iteration) and the captured long graph; racecheck over the long
# runtime. Final code (aligned first nodes, staggered rebuilds).
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
timeout 140 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T \
  --gtest_filter='Cuda/CudaRuntimeLong.MultiCtaSelectionEqualsHost/2:Long/CudaGraph.*hip_long' > $D/memcheck_long.log 2>&1 &
timeout 140 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 9 $T \
  --gtest_filter='Cuda/CudaRuntimeLong.MultiCtaSelectionEqualsHost/2' > $D/racecheck_long.log 2>&1 &
wait
for f in memcheck_long racecheck_long; do
  echo "== $f"; grep -E "^\[ RUN|^\[       OK|^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|RACECHECK SUMMARY" $D/$f.log | head -12
done
