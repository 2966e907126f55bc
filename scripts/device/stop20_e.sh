#!/usr/bin/env bash
# Stop 20, call E: the multi-CTA top-k at two CTAs per SM by default and for Quest from 4096 pages
# (was 16384). Tests; then at 128K (2%, 32 layers, batch 1): sparcas_bank and quest_bank with the
# defaults, with the old Quest threshold (KVFERRY_MCTA_MIN_PAGES=16384) and with one top-k CTA per
# SM, interleaved; SDPA; then each kernel's duration under ncu for one token step of each.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
F='*SelectTopK*:*SelectMcta*:*CudaRuntimeLong*:*CudaRuntimeTest*:*CudaGraph*:*CudaStepBank*:*GpuTopK*:*Sparcas*:*Quest*'
timeout 300 $T --gtest_brief=1 --gtest_filter="$F" > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
rm -f $D/rows.jsonl
run() {  # name, modes, env
  local name=$1 modes=$2; shift 2
  env "$@" timeout 150 $E --modes $modes --contexts 131072 --batches 1 --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2; do
  run default_$rep sparcas_bank,quest_bank KVFERRY_X=1
  run quest16k_$rep quest_bank KVFERRY_MCTA_MIN_PAGES=16384
  run ps1_$rep sparcas_bank,quest_bank KVFERRY_MCTA_PER_SM=1
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_e.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
NCU=/usr/local/cuda/bin/ncu
for m in sparcas_bank quest_bank; do
  timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --launch-skip 0 --launch-count 12000 --log-file $D/ncu_$m.csv \
    $E --modes $m --contexts 131072 --batches 1 --steps 1 --json $D/ncu_$m.jsonl > $D/ncu_$m.log 2>&1
  echo "ncu $m rc=$?"
done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
