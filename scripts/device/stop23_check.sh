#!/usr/bin/env bash
# Ready for the next GPU call (written in stop 23, which had no device time; it replaces
# review22_check.sh, which never ran). Owed checks:
#  - stop 22's review mends (1024ace: ResolveListRange through BankStepRows::Classify, MarkHit /
#    StageK; SparCas's re-map removed) and stop 23's 4-bit SparCas rows (SparcasGatherKernel's
#    4-bit branch, SparcasScoreQ4Kernel; the default now) have never run on a GPU: the whole suite
#    in two shards (CudaRuntimeTest compares the CUDA lists and outputs to the host backend's for
#    both row kinds: the default and the _bits16 cases), memcheck over the bank / runtime / SparCas
#    tests;
#  - the record against SDPA in the same call: sparcas_bank at 4 bits (the default) and at 16 bits
#    (the paper's rows, the stop-22 record's configuration), quest_bank; 32K and 128K b1, 128K b4.
# PART=tests (build, suite, memcheck) or PART=e2e (the record) splits it over two calls of 10 min.
set -u
PART=${PART:-all}
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
if [ "$PART" != e2e ]; then
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 300 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 $T \
  --gtest_brief=1 --gtest_filter='*CudaStepBank*:CudaRuntimeTest*sparcas*:CudaRuntimeLong*' > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|LEAK SUMMARY" $D/$f.log | head -12
done
fi
[ "$PART" = tests ] && exit 0
rm -f $D/rows.jsonl
kvf_e2e default_1 -- --modes sparcas_bank,quest_bank --contexts 32768,131072 --batches 1 --steps 10
kvf_e2e bits16_1 -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 10 --param bits=16
kvf_e2e default_4 -- --modes sparcas_bank,quest_bank --contexts 131072 --batches 4 --steps 10
kvf_e2e bits16_4 -- --modes sparcas_bank --contexts 131072 --batches 4 --steps 10 --param bits=16
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop23.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
