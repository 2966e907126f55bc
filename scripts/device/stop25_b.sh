#!/usr/bin/env bash
# Stop 25, call B: the mask kernel's radix histogram warp-aggregated (__match_any_sync) and a
# row's 16 words loaded into registers; the hip tests again; e2e hip_bank 128K b1 (default and
# dense_layers 0) beside sparcas_bank; nsys over hip_bank dense_layers 0: where a layer goes.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 150 $T --gtest_brief=1 --gtest_filter='*CudaEqualsHost*hip*:*CudaRuntimeLong*hip*:*DeviceSelected*:*CudaBankPressure*hip*:*CudaGraph*hip*' > $D/t_hip.log 2>&1
echo "== t_hip"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/t_hip.log | head -12
echo "tests: $(( $(date +%s) - t0 )) s"
rm -f $D/rows.jsonl
kvf_e2e hip_1 -- --modes hip_bank,sparcas_bank --contexts 131072 --batches 1 --steps 16
kvf_e2e hip_dl0_1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 --param dense_layers=0
timeout 80 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop25b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -4 $D/sdpa.log
if command -v nsys > /dev/null; then
  timeout 150 nsys profile --cuda-graph-trace=node -o $D/p_hip --force-overwrite true \
    $B/bench/kvferry-e2e --modes hip_bank --contexts 131072 --batches 1 --steps 16 --param dense_layers=0 \
    --json $D/nsys_hip.jsonl > $D/nsys_hip.log 2>&1
  timeout 90 nsys stats --report cuda_gpu_kern_sum --format csv -o $D/ksum_hip $D/p_hip.nsys-rep > /dev/null 2>&1
  rm -f $D/p_hip.nsys-rep $D/p_hip.sqlite
  head -14 $D/ksum_hip*.csv 2>/dev/null | cut -d, -f1-9,10 | cut -c1-200
else echo "no nsys"; fi
