#!/usr/bin/env bash
# Stop 27, call B: KVpop's step path in registers (the newcomer scored by a warp per hidden unit,
# the worst slot found with its index, the slots shifted through shuffles). The whole suite in two
# shards with memcheck over the kvpop CUDA tests beside it; racecheck over the long kvpop test;
# then e2e with keys unique: kvpop_bank 2% at 128K b1 and b4, 32K b1, with hip_bank beside it at
# 128K b1, and torch SDPA in the same call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 300 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
K='*CudaEqualsHost/*kvpop*:*CudaRuntimeLong*/3:*CudaGraph*kvpop*'
timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$K" > $D/memcheck.log 2>&1 &
timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*/3' > $D/racecheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck racecheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|RACECHECK SUMMARY" $D/$f.log | head -10
done
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e b_128k -- --modes kvpop_bank,hip_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e b_128k4 -- --modes kvpop_bank --contexts 131072 --batches 4 --steps 16 $U
kvf_e2e b_32k -- --modes kvpop_bank --contexts 32768 --batches 1 --steps 16 $U
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop27b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -4 $D/sdpa.log
