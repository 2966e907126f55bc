#!/usr/bin/env bash
# Stop 18, call C: the GPU scan's kernel tests (filter fixed: the suite is instantiated as
# Shapes/...), memcheck on them and on the CUDA runtime comparison, then lfps@2% auto at 32K and
# 64K: the scan on the GPU with the ranking awaited inside Select (default), before the Selects
# start (KVFERRY_LFPS_SCAN_WAIT=early), and the host scan (KVFERRY_LFPS_SCAN=host), twice each,
# interleaved, host timelines of the first; the scan kernels' GPU times (nsys); SDPA beside.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
timeout 200 $T --gtest_filter='*GpuLfpsScan*:LfpsPrimeRuntime.Cuda*:LfpsDeviceScan*:*CudaRuntimeTest*lfps*' > $D/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $D/tests.log | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' $D/tests.log | head -20
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $T --gtest_filter='*GpuLfpsScan*:LfpsPrimeRuntime.Cuda*' > $D/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' $D/memcheck.log | tr '\n' ' ')"
rm -f $D/rows.jsonl
run() {  # name, trace(0/1), env...
  local name=$1 tr=$2; shift 2
  local extra=""; [ "$tr" = 1 ] && extra="--trace $D/tr_$name"
  env "$@" timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 $extra --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*\|"lfps_scans_device[a-z_]*":[0-9.]*\|"select":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2; do
  run gpu_$rep $([ $rep = 1 ] && echo 1 || echo 0) KVFERRY_X=1
  run early_$rep 0 KVFERRY_LFPS_SCAN_WAIT=early
  run host_$rep $([ $rep = 1 ] && echo 1 || echo 0) KVFERRY_LFPS_SCAN=host
done
NS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [ -n "$NS" ]; then
  timeout 120 $NS profile -o $D/nsys_gpu -t cuda --force-overwrite true $E --modes lfps --contexts 32768,65536 --batches 1 --steps 5 --json $D/nsys.jsonl > $D/nsys.log 2>&1
  timeout 60 $NS stats --report cuda_gpu_kern_sum --format csv $D/nsys_gpu.nsys-rep > $D/kern_sum.csv 2>&1
  grep -i "scan\|Kernel\|Time" $D/kern_sum.csv | head -20
else echo "no nsys"; fi
rm -f $D/*.nsys-rep $D/*.sqlite
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
