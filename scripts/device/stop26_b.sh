#!/usr/bin/env bash
# Stop 26, call B: the side rebuild's CTA size (KVFERRY_HIP_SIDE_THREADS 256 / 512 / 1024: a
# smaller CTA leaves room on its SM for the step's kernels), hip_bank at 128K b1 and b4, keys
# unique, lag 0 beside; SDPA in the same call; then the hip CUDA tests on this build.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
rm -f $D/rows.jsonl
U=--unique-kv
for th in 256 512 1024; do
  kvf_e2e side${th}_b1 KVFERRY_HIP_SIDE_THREADS=$th -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U
done
kvf_e2e lag0_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param lag=0
for th in 256 512 1024; do
  kvf_e2e side${th}_b4 KVFERRY_HIP_SIDE_THREADS=$th -- --modes hip_bank --contexts 131072 --batches 4 --steps 16 $U
done
kvf_e2e side512_dl0_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param dense_layers=0
timeout 80 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop26b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -9 $D/sdpa.log
echo "e2e: $(( $(date +%s) - t0 )) s"
timeout 120 $T --gtest_brief=1 --gtest_filter='*CudaEqualsHost*hip*:*CudaRuntimeLong*:*DeviceSelected*:*CudaGraph*hip*:*GpuBytesCap*:*Hip*' > $D/t_hip.log 2>&1
KVFERRY_HIP_SIDE_THREADS=256 timeout 60 $T --gtest_brief=1 --gtest_filter='*CudaEqualsHost*hip*:*CudaRuntimeLong.MultiCtaSelectionEqualsHost/2:*CudaGraph*hip*' > $D/t_hip256.log 2>&1
for f in t_hip t_hip256; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/$f.log | head -12
done
