#!/usr/bin/env bash
# Stop 22, call D: the final code (the pipelined list step with 128-row splits by default; SparCas's
# refresh re-mapping its compact rows, SparcasState::remap). First the whole suite in two shards
# side by side and memcheck over the bank, step and runtime CUDA tests (CudaRuntimeTest now runs
# sparcas with u = 4 and a sparse layer, so the re-map meets changing dimensions against the host
# backend); then the record: sparcas_bank / quest_bank at 32K and 128K, batch 1 and 4, and the
# moving query (drift 0.5, 128 steps) for sparcas_bank with and without the re-map; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
CS=/usr/local/cuda/bin/compute-sanitizer
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 280 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
F='*CudaStepBank*:CudaRuntimeTest*sparcas*:CudaRuntimeLong*:*SelectTopK*'
timeout 280 $CS --tool memcheck --leak-check full --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$F" > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|LEAK SUMMARY" $D/$f.log | head -12
done
echo "suite: $(( $(date +%s) - t0 )) s"
rm -f $D/rows.jsonl
M=sparcas_bank,quest_bank
kvf_e2e default_1 -- --modes $M --contexts 32768,131072 --batches 1,4 --steps 10
if [ $(( $(date +%s) - t0 )) -lt 470 ]; then
  kvf_e2e drift05_remap -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 128 --query-drift 0.5
  kvf_e2e drift05_noremap KVFERRY_SPARCAS_REMAP=0 -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 128 --query-drift 0.5
fi
timeout 60 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_d.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
