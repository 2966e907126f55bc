#!/usr/bin/env bash
# Stop 21, call D: the device selection timed on its own (Runtime::TimeDeviceSelect,
# Stats::ms_select_device) and the bytes of keys it reads (Stats::select_key_bytes), both now in
# kvferry-e2e's rows. The long-runtime tests (which time the last steps) and the graph tests; then
# sparcas_bank and quest_bank at 32K and 128K, oracle_bank at 32K (2%, 32 layers, batch 1); SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
F='*CudaRuntimeLong*:*CudaGraph*:*SelectTopK*'
timeout 200 $T --gtest_brief=1 --gtest_filter="$F" > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
rm -f $D/rows.jsonl
run() {  # name, modes, contexts
  local name=$1 modes=$2 ctx=$3
  timeout 150 $E --modes $modes --contexts $ctx --batches 1 --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"context":[0-9]*\|"ms_per_token_step":[0-9.]*\|"ms_select_device_per_step":[0-9.e-]*\|"select_key_bytes_per_step":[0-9.e+]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
run select_1 sparcas_bank,quest_bank 32768,131072
run oracle_1 oracle_bank 32768
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_d.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
