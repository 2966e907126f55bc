#!/usr/bin/env bash
# Stop 19, call J: LFPS's cheaper settings again, now that the scan runs on the GPU (what they save
# is the exact scoring of fewer candidates and, for scan=8, nothing on the host): lfps@2% auto at
# 32K and 64K with the defaults, scan_factor=1 and scan=8, three times each, interleaved; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
run() {  # name, params...
  local name=$1; shift
  timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 "$@" --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*\|"lfps_scans_device_short_per_step":[0-9]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2 3; do
  run default_$rep
  run factor1_$rep --param scan_factor=1
  run scan8_$rep --param scan=8
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_j.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
