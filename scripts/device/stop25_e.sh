#!/usr/bin/env bash
# Stop 25, call E: HiP's first nodes aligned to a power of two blocks (the default now; the tree
# stays put as n grows, so a rebuilt mask changes only where the scores do):
#  - the hip CUDA tests (CUDA == host lists and outputs, the long runtime, graph capture, bank
#    pressure, the host-list tests) and memcheck over the hip ones;
#  - e2e, keys unique at every position: hip_bank at 128K b1 (default), with align 0 (the paper's
#    even nodes), with r_m 1 (a rebuild every step), with dense_layers 0; b4; 32K b1; SDPA beside.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 150 $T --gtest_brief=1 --gtest_filter='*CudaEqualsHost*hip*:*CudaRuntimeLong*:*DeviceSelected*:*CudaBankPressure*:*CudaGraph*hip*:*CudaGraphHostLists*:*CudaStepBank*:*GpuBytesCap*:*HostListBank*' > $D/t_hip.log 2>&1 &
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 \
  --gtest_filter='*CudaEqualsHost/hip_gpu_bank0*:*CudaEqualsHost/psaw_hip*:*CudaRuntimeLong/hip*' > $D/memcheck.log 2>&1 &
wait
for f in t_hip memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -12
done
echo "tests: $(( $(date +%s) - t0 )) s"
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e a_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e even_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param align=0
kvf_e2e a_rm1_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param r_m=1
kvf_e2e a_dl0_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param dense_layers=0
kvf_e2e a_b4 -- --modes hip_bank --contexts 131072 --batches 4 --steps 16 $U
kvf_e2e a_32k -- --modes hip_bank --contexts 32768 --batches 1 --steps 16 $U
timeout 80 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop25e.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -7 $D/sdpa.log
