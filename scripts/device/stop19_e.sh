#!/usr/bin/env bash
# Stop 19, call E: the whole test suite in two shards side by side, memcheck over the LFPS scan's
# kernel and runtime tests and the cap tests beside them (the pool's caller slot and the mapped
# ranking touch every CPU-route and LFPS test). Then lfps@2% auto at 32K and 64K: the default and
# 100 us of pool spinning between layers (KVFERRY_POOL_WARM_US=100, now that the caller keeps its
# core), three times each, interleaved; host timelines of the first; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
CS=/usr/local/cuda/bin/compute-sanitizer
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 420 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
F='*GpuLfpsScan*:LfpsPrimeRuntime.Cuda*:LfpsDeviceScan*:GpuBytesCapCuda.*'
timeout 400 $CS --tool memcheck --leak-check full --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$F" > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -12
done
rm -f $D/rows.jsonl
run() {  # name, trace(0/1), env...
  local name=$1 tr=$2; shift 2
  local extra=""; [ "$tr" = 1 ] && extra="--trace $D/tr_$name"
  env "$@" timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 $extra --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*\|"lfps_scans_device_short_per_step":[0-9]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2 3; do
  tr=$([ $rep = 1 ] && echo 1 || echo 0)
  run default_$rep $tr KVFERRY_X=1
  run warm100_$rep $tr KVFERRY_POOL_WARM_US=100
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_e.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
