#!/usr/bin/env bash
# Ready for the next GPU call (written in stop 21, not yet run): sparcas_bank and quest_bank at 128K
# (2%, 32 layers, batch 1) with the decode query fixed (--query-drift 0, as every earlier row) and
# moving (0.5, 1.0), 128 timed steps so that SparCas's every-64-steps refresh falls inside them;
# the selection timed alone and the bank's hits per step in each row; SDPA in the same call.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
for drift in 0 0.5 1.0; do
  name=drift_$drift
  timeout 180 $E --modes sparcas_bank,quest_bank --contexts 131072 --batches 1 --steps 128 \
    --query-drift $drift --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"ms_per_token_step":[0-9.]*\|"ms_select_device_per_step":[0-9.]*\|"rows_bank_hit_per_step":[0-9.e+]*\|"rows_fetched_per_step":[0-9.e+]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_drift.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
