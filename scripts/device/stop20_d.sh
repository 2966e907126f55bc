#!/usr/bin/env bash
# Stop 20, call D: the multi-CTA top-k's passes with four consecutive keys a thread (loads issued
# together, one pair of block scans per 2048 keys in the ordered write); the list step's splits at
# 128 rows at least. The device-selection and runtime tests; sparcas_bank, oracle_bank and
# quest_bank at 128K and 32K (2%, 32 layers, batch 1) with the top-k's CTAs at 4 / 3 / 2 per SM
# (KVFERRY_MCTA_PER_SM), interleaved; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
F='*SelectTopK*:*SelectMcta*:*CudaRuntimeLong*:*CudaRuntimeTest*:*CudaGraph*:*CudaStepBank*:*GpuTopK*:*Sparcas*:*Quest*'
timeout 300 $T --gtest_brief=1 --gtest_filter="$F" > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
rm -f $D/rows.jsonl
run() {  # name, contexts, env
  local name=$1 ctx=$2; shift 2
  env "$@" timeout 150 $E --modes sparcas_bank,quest_bank,oracle_bank --contexts $ctx --batches 1 --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"context":[0-9]*\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2; do
  for ps in 4 3 2; do run ps${ps}_$rep 131072 KVFERRY_MCTA_PER_SM=$ps; done
done
run ps4_32k 32768 KVFERRY_X=1
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_d.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
