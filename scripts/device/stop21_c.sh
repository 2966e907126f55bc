#!/usr/bin/env bash
# Stop 21, call C: the record and the whole suite, one call. First sparcas_bank and quest_bank at
# 2% (32 layers; 32K and 128K, batch 1 and 4) with this stop's defaults (the fused top-k; Quest's
# multi-CTA path from 4096 pages), at 128K batch 1 also with stop 20's (a launch a pass, Quest from
# 16384 pages); SDPA. Then the whole test suite in two
# shards side by side, and memcheck over the device selection's tests beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
run() {  # name, contexts, batches, env
  local name=$1 ctx=$2 bat=$3; shift 3
  env "$@" timeout 150 $E --modes sparcas_bank,quest_bank --contexts $ctx --batches $bat --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"context":[0-9]*\|"batch":[0-9]*\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
run default_1 32768,131072 1,4 KVFERRY_X=1
run stop20_knobs 131072 1 KVFERRY_MCTA_FUSED=0 KVFERRY_MCTA_MIN_PAGES=16384

timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
echo "record done: $(( $(date +%s) - t0 )) s"
left=$(( 585 - ($(date +%s) - t0) ))
CS=/usr/local/cuda/bin/compute-sanitizer
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout $left $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
F='*SelectTopK*:CudaRuntimeLong*:*CudaStepBank*:*Sparcas*Cuda*:CudaRuntimeTest*'
timeout $left $CS --tool memcheck --leak-check full --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$F" > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|LEAK SUMMARY" $D/$f.log | head -12
  tail -c 200 $D/$f.log | tail -1
done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
