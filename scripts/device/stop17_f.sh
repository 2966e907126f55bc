#!/usr/bin/env bash
# Stop 17, call F: lfps@2% auto at 32K and 64K with the pool's workers kept spinning between a
# layer's CPU items and the next layer's (CpuPool::KeepWarm, 500 us) against none
# (KVFERRY_POOL_WARM_US=0), three times each, interleaved; host timelines; SDPA beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
run() {  # name, env
  local name=$1 env=$2
  env $env timeout 90 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 --trace $D/tr_$name --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*' $D/$name.log | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2 3; do
  run warm_$rep KVFERRY_X=1
  run cold_$rep KVFERRY_POOL_WARM_US=0
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_f.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
