#!/usr/bin/env bash
# Stop 20, call F: SparCas's dense layers scored a thread per key from the compact rows; the
# multi-CTA top-k's statistics in one read per four query heads (online softmax); Quest's threshold
# back at 16384 pages. Tests; sparcas_bank and quest_bank at 128K twice; SDPA; each kernel's
# duration under ncu for one token step of sparcas_bank.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
F='*SelectTopK*:*SelectMcta*:*CudaRuntimeLong*:*CudaRuntimeTest*:*CudaGraph*:*CudaStepBank*:*GpuTopK*:*Sparcas*:*Quest*'
timeout 300 $T --gtest_brief=1 --gtest_filter="$F" > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
rm -f $D/rows.jsonl
for rep in 1 2; do
  name=default_$rep
  timeout 150 $E --modes sparcas_bank,quest_bank --contexts 131072 --batches 1 --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_f.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
NCU=/usr/local/cuda/bin/ncu
timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
  --launch-skip 0 --launch-count 12000 --log-file $D/ncu_sparcas_bank.csv \
  $E --modes sparcas_bank --contexts 131072 --batches 1 --steps 1 --json $D/ncu.jsonl > $D/ncu.log 2>&1
echo "ncu rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
