#!/usr/bin/env bash
# Stop 28, call B: the device bank's admission beside the next layer (two regions of miss staging,
# admit_stream_; KVFERRY_BANK_ADMIT_SIDE=0 keeps it on the caller's stream). The whole suite in two
# shards with memcheck over the bank tests beside it; then e2e A/B (keys unique, 2%): kvpop_bank,
# hip_bank and sparcas_bank at 128K b1, the admission beside and serial; torch SDPA in the same
# call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 300 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
K='CudaStepBank.*:*CudaGraph*bank*:GpuBytesCapCuda.*'
timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$K" > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -10
done
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e b_side -- --modes kvpop_bank,hip_bank,sparcas_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e b_serial KVFERRY_BANK_ADMIT_SIDE=0 -- --modes kvpop_bank,hip_bank,sparcas_bank --contexts 131072 --batches 1 --steps 16 $U
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop28b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -4 $D/sdpa.log
