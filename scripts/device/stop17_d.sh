#!/usr/bin/env bash
# Stop 17, call D: where lfps@2% auto spends its step at 32K inside the runtime: LFPS's phase
# profile (KVFERRY_LFPS_PROFILE=1, per Select), host timelines, and variants (no scan, 8 pool
# threads) in the same run.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
run() {  # name, extra args...
  local name=$1; shift
  KVFERRY_LFPS_PROFILE=1 timeout 90 $E --modes lfps --contexts 32768 --batches 1 --steps 10 --trace $D/tr_$name --json $D/rows.jsonl "$@" > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"ms_per_token_step":[0-9.]*' $D/$name.log | head -1) $(grep 'lfps profile' $D/$name.log | tail -1)"
}
run default
run scan0 --param scan=0
run threads8 --cpu-threads 8
run scan_every_step --param scan_max_period=1
run default2
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
