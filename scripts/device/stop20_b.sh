#!/usr/bin/env bash
# Stop 20, call B: SparCas's dense layers scored from their compact rows on the device (not the
# host store over PCIe). The device-selection and runtime tests; then sparcas_bank and quest_bank
# at 128K (2%, 32 layers, batch 1) with the list step's splits at the default 256 rows at least and
# at 128 / 64 / 32 (KVFERRY_STEP_MIN_CHUNK), interleaved; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
F='*SelectTopK*:*SelectMcta*:*CudaRuntimeLong*:*CudaRuntimeTest*:*CudaGraph*:*CudaStepBank*:*GpuTopK*:*Sparcas*'
timeout 300 $T --gtest_brief=1 --gtest_filter="$F" > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
rm -f $D/rows.jsonl
run() {  # name, env
  local name=$1; shift
  env "$@" timeout 100 $E --modes sparcas_bank,quest_bank --contexts 131072 --batches 1 --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2; do
  for mc in 256 128 64 32; do run mc${mc}_$rep KVFERRY_STEP_MIN_CHUNK=$mc; done
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
