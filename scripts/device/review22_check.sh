#!/usr/bin/env bash
# Ready for the next GPU call (written in stop 22's review, not yet run: the device time was spent):
# the review mends of 1024ace touched GPU code after the last GPU run (ResolveListRange through
# BankStepRows::Classify / MarkHit / StageK; SparCas's re-map taken out, so CudaRuntimeTest's
# sparcas cases with u = 4 re-gather whole rows on CUDA). The whole suite in two shards, memcheck
# over the bank / runtime / SparCas tests, then sparcas_bank / quest_bank at 32K and 128K b1 and
# 128K b4 against SDPA in the same call.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 300 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 $T \
  --gtest_brief=1 --gtest_filter='*CudaStepBank*:CudaRuntimeTest*sparcas*:CudaRuntimeLong*' > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|LEAK SUMMARY" $D/$f.log | head -12
done
rm -f $D/rows.jsonl
kvf_e2e default_1 -- --modes sparcas_bank,quest_bank --contexts 32768,131072 --batches 1 --steps 10
kvf_e2e default_4 -- --modes sparcas_bank,quest_bank --contexts 131072 --batches 4 --steps 10
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_review.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
