#!/usr/bin/env bash
# Stop 26, call F: a k_off that grows (the 2% budget of a growing n) no longer forces a rebuild
# of every layer at once (HipMaskStale): the hip CUDA tests, then e2e with keys unique: hip_bank
# 2% at 128K b1 and b4, and the flat check at a fixed 2622-token budget, 128K and 512K b1; SDPA.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 60 $T --gtest_brief=1 --gtest_filter='*CudaEqualsHost*hip*:*CudaRuntimeLong*:*DeviceSelected*:*CudaGraph*hip*:*Hip*' > $D/t_hip.log 2>&1
echo "== t_hip"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/t_hip.log | head -8
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e f_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e f_b4 -- --modes hip_bank --contexts 131072 --batches 4 --steps 16 $U
cp $D/rows.jsonl $D/rows_frac.jsonl
kvf_e2e flat -- --modes hip_bank --contexts 131072,524288 --batches 1 --steps 16 $U --budget-tokens 2622 --host-gib 110
timeout 90 python3 scripts/device/e2e_sdpa.py $D/rows_frac.jsonl $D/e2e_stop26f.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -3 $D/sdpa.log
