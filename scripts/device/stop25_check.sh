#!/usr/bin/env bash
# For the next session's first GPU call (written in stop 24, whose device time ran out):
#  - the whole suite in two shards on stop 24's final code (the integer 4-bit scoring, the
#    block-reduced weights merge, the Mcta scratch of 512 statistics slots a head, SymQuant*);
#    stop 24 ran only the SparCas, top-k, CUDA-vs-host and long-runtime tests on it;
#  - memcheck over CudaRuntimeLong (oracle and sparcas: the multi-CTA path) with the statistics
#    fold off (the default) and on (KVFERRY_SPARCAS_SCORE_STATS=1); stop 24's memcheck filter
#    matched no test;
#  - where a sparse layer's time goes now: nsys with --cuda-graph-trace=node over sparcas_bank at
#    128K b1 (4 steps), every kernel's start and end as CSV.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 300 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
timeout 200 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 $T \
  --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*' > $D/memcheck.log 2>&1 &
KVFERRY_SPARCAS_SCORE_STATS=1 timeout 200 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
  --error-exitcode 9 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*' > $D/memcheck_fold.log 2>&1 &
wait
for f in shard0 shard1 memcheck memcheck_fold; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|LEAK SUMMARY" $D/$f.log | head -12
done
echo "tests: $(( $(date +%s) - t0 )) s"
if command -v nsys > /dev/null; then
  timeout 150 nsys profile --cuda-graph-trace=node -o $D/p_q4 --force-overwrite true \
    $B/bench/kvferry-e2e --modes sparcas_bank --contexts 131072 --batches 1 --steps 4 \
    --json $D/nsys_q4.jsonl > $D/nsys_q4.log 2>&1
  timeout 90 nsys stats --report cuda_gpu_kern_sum --format csv -o $D/ksum_q4 $D/p_q4.nsys-rep > /dev/null 2>&1
  timeout 90 nsys stats --report cuda_gpu_trace --format csv -o $D/k_q4 $D/p_q4.nsys-rep > /dev/null 2>&1
  rm -f $D/p_q4.nsys-rep $D/p_q4.sqlite
  head -20 $D/ksum_q4*.csv 2>/dev/null | cut -c1-160
  gzip -f $D/k_q4*.csv 2>/dev/null
else echo "no nsys"; fi
