#!/usr/bin/env bash
# Stop 16, call B: build; prefill rows in chunk-major order with the next call's history
# prefetched (one batched copy enqueue) and without (KVFERRY_PREFILL_PREFETCH=0); the dense
# all-resident decode rows with the step kernel's PDL and L2 warm-up and without
# (KVFERRY_STEP_PDL=0); all next to torch SDPA in the same run.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
P="--modes prefill_dense,prefill_lfps --contexts ${PCTX:-8192,32768,131072} --prefill-chunks 2048,8192"
timeout 120 $E $P --prefill-order chunk --json $D/rows.jsonl > $D/pf_chunk.log 2>&1; echo "chunk rc=$?"
KVFERRY_PREFILL_PREFETCH=0 timeout 120 $E $P --prefill-order chunk --json $D/nopf.jsonl > $D/pf_nopf.log 2>&1; echo "chunk nopf rc=$?"
python3 -c "
import json
for l in open('$D/nopf.jsonl'):
    r=json.loads(l); r['mode']+='_noprefetch'; print(json.dumps(r))" >> $D/rows.jsonl
echo "prefill: $(( $(date +%s) - t0 )) s"
timeout 200 $E --modes dense_resident --contexts 32768,131072 --batches 1,4 --steps 10 --json $D/rows.jsonl > $D/dec.log 2>&1; echo "decode rc=$?"
KVFERRY_STEP_PDL=0 timeout 100 $E --modes dense_resident --contexts 32768 --batches 1,4 --steps 10 --json $D/nopdl.jsonl > $D/dec_nopdl.log 2>&1; echo "decode nopdl rc=$?"
KVFERRY_STEP_PDL=0 timeout 60 $E --modes dense_resident --contexts 131072 --batches 1 --steps 10 --json $D/nopdl.jsonl >> $D/dec_nopdl.log 2>&1; echo "decode nopdl 128K rc=$?"
python3 -c "
import json
for l in open('$D/nopdl.jsonl'):
    r=json.loads(l); r['mode']+='_nopdl'; print(json.dumps(r))" >> $D/rows.jsonl
echo "decode: $(( $(date +%s) - t0 )) s"
timeout 150 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_b.json > $D/sdpa.log 2>&1
python3 -c "
import json
for r in json.load(open('$D/e2e_b.json'))['rows']:
    if r['name']=='prefill': print(r['mode'], r.get('order'), r['context'], r['chunk'], round(r['ms_per_layer'],2), round(r['ratio'],3), 'prime', round(r.get('ratio_with_prime',0),3), 'prefetched', r.get('chunks_prefetched'))
    else: print(r['mode'], r['context'], r['batch'], round(r['ms_per_token_step'],3), round(r['ratio'],3))"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
