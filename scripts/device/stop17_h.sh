#!/usr/bin/env bash
# Stop 17, call H: more points of issue 14's scale table under the 8 GiB cap: lfps (CPU) at
# batch 4 and 16, the other PrHS wrappers (psaw+, xl+) around quest with the bank, lfps with its
# selected rows read by the GPU (route gpu); SDPA (uncapped) beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E="$B/bench/kvferry-e2e --gpu-gib 8 --steps 3 --json $D/rows.jsonl"
rm -f $D/rows.jsonl
step() { local t=$1; shift; timeout $t $E "$@" >> $D/run.log 2>&1; echo "$* rc=$? at $(( $(date +%s) - t0 )) s"; }
step 120 --contexts 131072 --batches 1 --modes psaw+quest_bank,xl+quest_bank,lfps_gpu,psaw+lfps
step 150 --contexts 131072 --batches 4 --modes lfps
step 170 --contexts 32768 --batches 16 --modes lfps
timeout 90 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/scale.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
python3 -c "
import json
for r in json.load(open('$D/scale.json'))['rows']:
    print(r['mode'], r['context'], r['batch'], r.get('skipped') or '', round(r.get('ms_per_token_step',0),2), 'ratio', round(r.get('ratio',0),3), 'bank', r.get('bank_slots_chosen'), 'stages', r.get('stages_ms_per_step'))" 2>&1 | tail -20
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
