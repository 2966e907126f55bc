#!/usr/bin/env bash
# Stop 20, call G: programmatic dependent launch for the selection's kernels and the bank's
# admission (gpu/pdl.cuh); the multi-CTA grid rounded down to one wave. Tests; sparcas_bank and
# quest_bank at 128K and 32K with it and without (KVFERRY_SELECT_PDL=0), interleaved; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
F='*SelectTopK*:*SelectMcta*:*CudaRuntimeLong*:*CudaRuntimeTest*:*CudaGraph*:*CudaStepBank*:*GpuTopK*:*Sparcas*:*Quest*:*DeviceBank*:*Bank/*'
timeout 300 $T --gtest_brief=1 --gtest_filter="$F" > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
rm -f $D/rows.jsonl
run() {  # name, env
  local name=$1; shift
  env "$@" timeout 150 $E --modes sparcas_bank,quest_bank --contexts 32768,131072 --batches 1 --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"context":[0-9]*\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2; do
  run pdl_$rep KVFERRY_X=1
  run nopdl_$rep KVFERRY_SELECT_PDL=0
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_g.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
