#!/usr/bin/env bash
# Stop 25, call A: HiP's masks on the device (SelectScoring::kHip: 4-bit rows of every dimension
# kept by SparCas's prep and gather kernels, HipMaskKernel rebuilds an item's mask every r_m steps
# and writes its list otherwise).
#  - the tests that reach it: CUDA == host backend lists and outputs (CudaEqualsHost hip, psaw+hip,
#    the long runtime with one-token blocks: 2964 nodes), graph capture with the bank and long,
#    bank pressure, the memory plan; memcheck over the long hip runtime and its graph;
#  - e2e at 128K, 2%, the bank on, 16 timed steps (two rebuilds at r_m 8): hip_bank b1 / b4, with
#    the paper's offload setting dense_layers 0, next to sparcas_bank and quest_bank; SDPA beside.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 150 $T --gtest_brief=1 --gtest_filter='*CudaEqualsHost*hip*:*CudaRuntimeLong*:*DeviceSelected*:*CudaBankPressure*:*CudaGraph*hip*:*GpuBytesCap*:*HostListBank*' > $D/t_hip.log 2>&1 &
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 \
  --gtest_filter='*CudaRuntimeLong*hip*:*CudaEqualsHost/hip_gpu_bank0*' > $D/memcheck.log 2>&1 &
wait
for f in t_hip memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -12
done
echo "tests: $(( $(date +%s) - t0 )) s"
rm -f $D/rows.jsonl
kvf_e2e hip_1 -- --modes hip_bank,sparcas_bank,quest_bank --contexts 131072 --batches 1 --steps 16
kvf_e2e hip_dl0_1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 --param dense_layers=0
kvf_e2e hip_4 -- --modes hip_bank --contexts 131072 --batches 4 --steps 16
timeout 80 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop25a.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -8 $D/sdpa.log
