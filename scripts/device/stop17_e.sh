#!/usr/bin/env bash
# (The spawn change it measured, commit b88d3ba, was reverted: no gain in start latency or step time.)
# Stop 17, call E: lfps@2% auto at 32K and 64K with the pool's items and LFPS's scan ranges spawned
# one task each, against tbb::parallel_for (KVFERRY_POOL_SPAWN=0), and with the scan every step
# (scan_max_period=1), each twice, interleaved; LFPS's phase profile and a host timeline.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
run() {  # name, env, extra args...
  local name=$1 env=$2; shift 2
  env $env KVFERRY_LFPS_PROFILE=1 timeout 90 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 --trace $D/tr_$name --json $D/$name.jsonl "$@" > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*' $D/$name.log | tr '\n' ' ') $(grep 'lfps profile' $D/$name.log | tr '\n' ' ')"
  python3 -c "
import json,sys
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2; do
  run spawn_$rep KVFERRY_X=1
  run parallel_for_$rep KVFERRY_POOL_SPAWN=0
  run spawn_scan_every_$rep KVFERRY_X=1 --param scan_max_period=1
  run parallel_for_scan_every_$rep KVFERRY_POOL_SPAWN=0 --param scan_max_period=1
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_e.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
