#!/usr/bin/env bash
# Stop 16, call C: build; compute-sanitizer racecheck and memcheck on single small cases of the
# kernels this stop changed or had not checked (decode step with PDL, chunk-major prefill with the
# prefetch, prime, select top-k); the whole GPU test suite in two shards.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
CS=/usr/local/cuda/bin/compute-sanitizer
san() {  # tool filter
  local n; n=$(echo "$1_$2" | tr -c 'a-zA-Z0-9\n' '_' | cut -c1-80)
  timeout ${SAN_T:-60} $CS --tool $1 $T --gtest_brief=1 --gtest_filter="$2" > $D/san_$n.txt 2>&1
  echo "$1 $2 rc=$? $(grep -hE 'tests ran' $D/san_$n.txt | head -1) | $(grep -hE 'SUMMARY' $D/san_$n.txt | head -1)"
}
for i in 0 1; do
  left=$(( 430 - ($(date +%s) - t0) ))
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout $left $T --gtest_brief=1 > $D/tests$i.log 2>&1; echo "tests shard $i rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests$i.log | head -12
done
echo "tests: $(( $(date +%s) - t0 )) s"
[ $(( $(date +%s) - t0 )) -lt 490 ] && san racecheck '*CudaPlannedStep.DeviceAndHostTensorsAgree*'
[ $(( $(date +%s) - t0 )) -lt 490 ] && san racecheck '*GpuSelectTopKTest.BothPathsEqualTheHostReference/oracle_b2_g3_n4099_k97_lv64'
[ $(( $(date +%s) - t0 )) -lt 490 ] && san racecheck '*GpuSelectTopKTest.BothPathsEqualTheHostReference/sparcas_b2_g4_n300_k50_lv16'
[ $(( $(date +%s) - t0 )) -lt 490 ] && san memcheck '*CudaPrefillStaged.ChunkMajorPrefetchesTheNextCallsHistory*'
[ $(( $(date +%s) - t0 )) -lt 490 ] && san memcheck '*CudaPlannedStep.DeviceAndHostTensorsAgree*'
echo "sanitizers: $(( $(date +%s) - t0 )) s"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
