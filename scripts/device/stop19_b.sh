#!/usr/bin/env bash
# Stop 19, call B: the CPU pool's adaptive spin between layers (WarmMicros). Tests: the LFPS
# device scan's kernel and runtimes, every Lfps and CUDA runtime test. Then lfps@2% auto at 32K and
# 64K: the adaptive spin (default), no spin (KVFERRY_POOL_WARM_US=0), a fixed 300 us, three times
# each, interleaved; host timelines (with the launch spans) of the first; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
timeout 240 $T --gtest_filter='*GpuLfpsScan*:Lfps*:*CudaRuntime*:*CudaGraph*:CpuPool*:PoolWarm*:*Concurrency*' > $D/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $D/tests.log | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' $D/tests.log | head -20
rm -f $D/rows.jsonl
run() {  # name, trace(0/1), env...
  local name=$1 tr=$2; shift 2
  local extra=""; [ "$tr" = 1 ] && extra="--trace $D/tr_$name"
  env "$@" timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 $extra --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2 3; do
  tr=$([ $rep = 1 ] && echo 1 || echo 0)
  run adaptive_$rep $tr KVFERRY_X=1
  run off_$rep $tr KVFERRY_POOL_WARM_US=0
  run fixed300_$rep $tr KVFERRY_POOL_WARM_US=300
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
