#!/usr/bin/env bash
# Stop 17, call G: first points of issue 14's scale table. 32 layers of the Llama-3.1-8B attention
# shape, device tensors, the runtime's device memory capped at 8 GiB (a 24 GB card minus 16 GB of
# weights; --gpu-gib 8, the bank modes take the largest bank that fits); lfps (CPU) and quest with
# the bank (GPU), with and without PrHS's temporal sharing (cis+); full PCIe streaming and dense
# CPU attention as the baselines; torch SDPA with all KV on the (uncapped) GPU beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E="$B/bench/kvferry-e2e --gpu-gib 8 --steps 3 --json $D/rows.jsonl"
rm -f $D/rows.jsonl
step() { local t=$1; shift; timeout $t $E "$@" >> $D/run.log 2>&1; echo "$* rc=$? at $(( $(date +%s) - t0 )) s"; }
step 150 --contexts 131072 --batches 1 --modes lfps,cis+lfps,quest_bank,cis+quest_bank,full_streaming,dense_cpu
step 100 --contexts 524288 --batches 1 --modes quest_bank,lfps
step 90 --contexts 32768 --batches 16 --modes quest_bank,lfps
step 60 --contexts 131072 --batches 4 --modes quest_bank
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/scale.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
python3 -c "
import json
for r in json.load(open('$D/scale.json'))['rows']:
    print(r['mode'], r['context'], r['batch'], r.get('skipped') or '', round(r.get('ms_per_token_step',0),2), 'ratio', round(r.get('ratio',0),3), 'bank', r.get('bank_slots_chosen'), 'gpu', r.get('gpu_bytes'))" 2>&1 | tail -20
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
