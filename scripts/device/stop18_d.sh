#!/usr/bin/env bash
# Stop 18, call D: lfps@2% auto at 32K and 64K, four variants, twice each, interleaved, host
# timelines (with cpu_select / cpu_attend spans) of the first: the GPU scan and the split CPU
# attention (defaults), without the split (KVFERRY_CPU_ATTEND_SPLIT=0), the host scan with the
# split, neither (the state before this stop). SDPA beside; the CUDA lfps tests first.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
timeout 200 $T --gtest_filter='*GpuLfpsScan*:LfpsPrimeRuntime.Cuda*:LfpsDeviceScan*:*CudaRuntimeTest*lfps*:LfpsScanTest.*' > $D/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $D/tests.log | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' $D/tests.log | head -20
rm -f $D/rows.jsonl
run() {  # name, trace(0/1), env...
  local name=$1 tr=$2; shift 2
  local extra=""; [ "$tr" = 1 ] && extra="--trace $D/tr_$name"
  env "$@" timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 $extra --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*\|"select":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2; do
  tr=$([ $rep = 1 ] && echo 1 || echo 0)
  run gpu_split_$rep $tr KVFERRY_X=1
  run gpu_nosplit_$rep $tr KVFERRY_CPU_ATTEND_SPLIT=0
  run host_split_$rep $tr KVFERRY_LFPS_SCAN=host
  run host_nosplit_$rep $tr KVFERRY_LFPS_SCAN=host KVFERRY_CPU_ATTEND_SPLIT=0
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_d.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
