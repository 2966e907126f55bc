#!/usr/bin/env bash
# Stop 18, call B: LFPS's scan on the GPU (gpu/lfps_scan.cu). Its tests (the kernel against
# cpu::LfpsScanRef, the CUDA runtimes against the host backend and a host-scanning CUDA runtime,
# the CUDA runtime tests' lfps cases), memcheck on the kernel test, then lfps@2% auto at 32K and
# 64K with the scan on the GPU (default) and on the host (KVFERRY_LFPS_SCAN=host), interleaved,
# SDPA beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
timeout 240 $T --gtest_filter='GpuLfpsScan*:LfpsPrimeRuntime.*:LfpsDeviceScan*:LfpsScanTest.*:*CudaRuntimeTest*' > $D/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $D/tests.log | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' $D/tests.log | head -20
timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $T --gtest_filter='GpuLfpsScan*' > $D/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED' $D/memcheck.log | tr '\n' ' ')"
rm -f $D/rows.jsonl
run() {  # name, env...
  local name=$1; shift
  env "$@" timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"context":[0-9]*\|"ms_per_token_step":[0-9.]*\|"lfps_scans_device[a-z_]*":[0-9]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
for rep in 1 2 3; do
  run gpu_scan_$rep KVFERRY_X=1
  run host_scan_$rep KVFERRY_LFPS_SCAN=host
done
KVFERRY_LFPS_PROFILE=1 timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 --json $D/profile.jsonl > $D/profile.log 2>&1
echo "profile rc=$?"; grep -i "lfps\|scan" $D/profile.log | tail -8
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
