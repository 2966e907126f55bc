#!/usr/bin/env bash
# Stop 16: the decode step kernel with programmatic dependent launch at two CTAs per SM and
# KVFERRY_STEP_PREFETCH tiles warmed in L2 before griddepcontrol.wait, against KVFERRY_STEP_PDL=0
# in the same run (dense all-resident, next to torch SDPA); the prefill rows of issue 11 at 8K,
# 32K and 128K (chunks 2K / 8K, dense and lfps), layer by layer.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
run() {  # tag pdl prefetch contexts batches
  KVFERRY_STEP_PDL=$2 KVFERRY_STEP_PREFETCH=$3 timeout 100 $E --modes dense_resident --contexts $4 --batches $5 --steps 10 --json $D/v_$1.jsonl > $D/v_$1_$4_$5.log 2>&1 || echo "e2e $1 $4 $5 failed"
}
for ctx in 32768 131072; do
  run nopdl 0 0 $ctx 1; run pdl_pf3 1 3 $ctx 1; run pdl_pf8 1 8 $ctx 1; run pdl_pf0 1 0 $ctx 1
done
run nopdl 0 0 32768 4; run pdl_pf8 1 8 32768 4
for t in nopdl pdl_pf3 pdl_pf8 pdl_pf0; do
  python3 -c "
import json
for l in open('$D/v_$t.jsonl'):
    r=json.loads(l); r['mode']+='_$t'; print(json.dumps(r))" >> $D/rows.jsonl
done
echo "decode: $(( $(date +%s) - t0 )) s"
timeout 200 $E --modes prefill_dense,prefill_lfps --contexts 8192,32768,131072 --prefill-chunks 2048,8192 --json $D/rows.jsonl > $D/pf.log 2>&1; echo "prefill rc=$?"
echo "prefill: $(( $(date +%s) - t0 )) s"
timeout 150 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop16.json > $D/sdpa.log 2>&1; tail -30 $D/sdpa.log
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
