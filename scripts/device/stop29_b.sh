#!/usr/bin/env bash
# Stop 29, call B: the CPU part of a CPU-placed policy's planned step on the runtime's own thread
# (RuntimeConfig::async_cpu, on by default with CUDA; the stream waits on a mapped host word,
# Device::WaitHostValue). The whole suite in two shards (every lfps CUDA test now runs the
# asynchronous part), memcheck over the new test and lfps's CUDA-equals-host cases beside them.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 120 $T --gtest_filter='CudaCpuPart.*:*CudaEqualsHost*lfps*:AsyncCpuPart.*:*FailingPolicy*' > $D/t.log 2>&1
echo "targeted rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|FAILED" $D/t.log | head -20
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 330 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
K='CudaCpuPart.*:*CudaEqualsHost*lfps*'
timeout 330 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$K" > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -10
done
