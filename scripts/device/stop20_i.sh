#!/usr/bin/env bash
# Stop 20, call I: the record. sparcas_bank and quest_bank at 2% (32 layers, batch 1 and 4, 32K
# and 128K) with this stop's defaults, twice; at 128K batch 1 also with the list step's old split
# size and the top-k's old grid (KVFERRY_STEP_MIN_CHUNK=256 KVFERRY_MCTA_PER_SM=4); SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
run() {  # name, contexts, batches, env
  local name=$1 ctx=$2 bat=$3; shift 3
  env "$@" timeout 200 $E --modes sparcas_bank,quest_bank --contexts $ctx --batches $bat --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"context":[0-9]*\|"batch":[0-9]*\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
run default_1 32768,131072 1,4 KVFERRY_X=1
run old_knobs 131072 1 KVFERRY_STEP_MIN_CHUNK=256 KVFERRY_MCTA_PER_SM=4
run default_2 32768,131072 1,4 KVFERRY_X=1
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_i.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
