#!/usr/bin/env bash
# Stop 26, call A: HiP's `lag` 1 (the default now: a due mask rebuild runs on a side stream beside
# the step and serves from the item's next ranked step):
#  - the hip CUDA tests (CUDA == host lists and outputs for lag 1 and lag 0, the long runtime,
#    graph capture, bank pressure, host lists) and memcheck / racecheck over the lag-1 ones;
#  - e2e, keys unique: hip_bank at 128K b1 with lag 1 and lag 0 in one call, dense_layers 0, b4;
#    SDPA beside.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
SAN=/usr/local/cuda/bin/compute-sanitizer
timeout 150 $T --gtest_brief=1 --gtest_filter='*CudaEqualsHost*hip*:*CudaRuntimeLong*:*DeviceSelected*:*CudaBankPressure*:*CudaGraph*hip*:*CudaGraphHostLists*:*CudaStepBank*:*GpuBytesCap*:*HostListBank*:*Hip*' > $D/t_hip.log 2>&1 &
timeout 170 $SAN --tool memcheck --error-exitcode 9 $T --gtest_brief=1 \
  --gtest_filter='*CudaEqualsHost/hip_gpu_bank0*:*CudaEqualsHost/psaw_hip*:*CudaRuntimeLong.MultiCtaSelectionEqualsHost/2:*CudaGraph*hip_bank*' > $D/memcheck.log 2>&1 &
timeout 170 $SAN --tool racecheck --error-exitcode 9 $T --gtest_brief=1 \
  --gtest_filter='*CudaEqualsHost/hip_gpu_bank0*' > $D/racecheck.log 2>&1 &
wait
for f in t_hip memcheck racecheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY|RACECHECK SUMMARY" $D/$f.log | head -12
done
echo "tests: $(( $(date +%s) - t0 )) s"
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e lag1_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e lag0_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param lag=0
kvf_e2e lag1_dl0_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param dense_layers=0
kvf_e2e lag1_b4 -- --modes hip_bank --contexts 131072 --batches 4 --steps 16 $U
timeout 80 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop26a.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -7 $D/sdpa.log
