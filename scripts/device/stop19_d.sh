#!/usr/bin/env bash
# Stop 19, call D: the CPU pool keeps an arena slot for the caller, who is no longer re-pinned to a
# worker's core on each entry (the scan's ranking now always mapped, the copy path gone). Tests: the kernel against
# cpu::LfpsScanRef in both memories, the CUDA runtimes against the host backend, every Lfps and
# CUDA runtime test; memcheck on the kernel and runtime tests. Then lfps@2% auto at 32K and 64K:
# the caller's slot (default) and the old arena (KVFERRY_POOL_MASTER_SLOT=0), three times each, interleaved;
# host timelines of the first; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
timeout 240 $T --gtest_filter='*GpuLfpsScan*:Lfps*:*CudaRuntime*:*CudaGraph*:CpuPool*:*Concurrency*:GpuBytesCap*' > $D/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $D/tests.log | tr '\n' ' ')"
grep -E '^\[  FAILED  \]|listed' $D/tests.log | head -20
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $T --gtest_filter='*GpuLfpsScan*:LfpsPrimeRuntime.Cuda*:LfpsDeviceScan*' > $D/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' $D/memcheck.log | tr '\n' ' ')"
rm -f $D/rows.jsonl
run() {  # name, trace(0/1), env...
  local name=$1 tr=$2; shift 2
  local extra=""; [ "$tr" = 1 ] && extra="--trace $D/tr_$name"
  env "$@" timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 $extra --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*\|"lfps_scans_device[a-z_]*":[0-9]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2 3; do
  tr=$([ $rep = 1 ] && echo 1 || echo 0)
  run slot_$rep $tr KVFERRY_X=1
  run noslot_$rep $tr KVFERRY_POOL_MASTER_SLOT=0
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_d.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
