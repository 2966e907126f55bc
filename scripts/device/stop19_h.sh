#!/usr/bin/env bash
# Stop 19, call H: issue 14's scale-table lfps rows again, now that LFPS's scan runs on the GPU
# (its int8 shadow of K, 4 GiB at 128K x 1 over 32 layers, fits the 8 GiB cap beside the rest) and
# the pool keeps the caller's slot: 128K x 1, lfps with and without PrHS's cis+ and psaw+, full PCIe
# streaming and dense CPU attention as the baselines, torch SDPA (uncapped) beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E="$B/bench/kvferry-e2e --gpu-gib 8 --steps 3 --json $D/rows.jsonl"
rm -f $D/rows.jsonl
step() { local t=$1; shift; timeout $t $E "$@" >> $D/run.log 2>&1; echo "$* rc=$? at $(( $(date +%s) - t0 )) s"; }
step 200 --contexts 131072 --batches 1 --modes lfps,cis+lfps,psaw+lfps,full_streaming,dense_cpu
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/scale.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
python3 -c "
import json
for r in json.load(open('$D/scale.json'))['rows']:
    print(r['mode'], r['context'], r['batch'], r.get('skipped') or '', round(r.get('ms_per_token_step',0),2), 'ratio', round(r.get('ratio',0),3), 'gpu', r.get('gpu_bytes'), 'scans', r.get('lfps_scans_device_per_step'), 'short', r.get('lfps_scans_device_short_per_step'), 'syncs', r.get('host_syncs_per_step'))" 2>&1 | tail -20
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
