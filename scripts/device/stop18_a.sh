#!/usr/bin/env bash
# Stop 18, call A: lfps@2% auto at 32K and 64K with the cheaper scans that keep SmolLM2's
# perplexity (scan=8: 8 int8 channels; scan_factor=1: the scan nominates k keys, not 2k; both)
# against the defaults, three times each, interleaved; SDPA beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
run() {  # name, params...
  local name=$1; shift
  timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 "$@" --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2 3; do
  run default_$rep
  run scan8_$rep --param scan=8
  run factor1_$rep --param scan_factor=1
  run both_$rep --param scan=8 --param scan_factor=1
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_a.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
