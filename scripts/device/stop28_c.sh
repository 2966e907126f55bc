#!/usr/bin/env bash
# Stop 28, call C: the admission's default per policy (beside the step, except hip with its side
# rebuilds). The bank, graph, cap and hip CUDA tests; e2e (keys unique, 2%): hip_bank, kvpop_bank
# and sparcas_bank at 128K b1, kvpop_bank and sparcas_bank at 128K b4 and 32K b1 with the defaults; torch
# SDPA in the same call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 200 $T --gtest_brief=1 --gtest_filter='CudaStepBank.*:*CudaGraph*:GpuBytesCapCuda.*:*CudaEqualsHost/*hip*:*CudaEqualsHost/*bank*' > $D/t_c.log 2>&1
echo "== t_c"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/t_c.log | head -10
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e c_128k -- --modes hip_bank,kvpop_bank,sparcas_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e c_128k4 -- --modes kvpop_bank,sparcas_bank --contexts 131072 --batches 4 --steps 16 $U
kvf_e2e c_32k -- --modes kvpop_bank,sparcas_bank --contexts 32768 --batches 1 --steps 16 $U
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop28c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -6 $D/sdpa.log
