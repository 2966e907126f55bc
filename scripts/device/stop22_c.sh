#!/usr/bin/env bash
# Stop 22, call C: the pipelined list step (gpu/decode_step.cu: each CTA resolves its list rows
# through the bank into a shared-memory table, misses staged from the host store, then the cp.async
# tensor-core loop). Tests of the step, the bank and the runtime on CUDA; memcheck of the bank
# tests; then, in one call, sparcas_bank / quest_bank at 32K and 128K b1 with the new step (split
# sizes 32 / 64 / 128 rows) and the register loop (KVFERRY_STEP_LIST_PIPE=0), the moving query
# (drift 1.0) both ways, batch 4 at 128K; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='*CudaStepBank*:*CudaRuntime*:*CudaGraph*:*HostListBank*:*GpuBytesCap*:*DeviceBank*:*SelectTopK*:*CudaPrefill*'
timeout 240 $T --gtest_brief=1 --gtest_filter="$F" > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -20
timeout 200 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --leak-check full $T --gtest_brief=1 \
  --gtest_filter='*CudaStepBank*:CudaRuntimeLong*' > $D/memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E "^\[  (PASSED|FAILED) |ERROR SUMMARY|LEAK SUMMARY" $D/memcheck.log | head -5
echo "tests: $(( $(date +%s) - t0 )) s"
rm -f $D/rows.jsonl
M=sparcas_bank,quest_bank
kvf_e2e reg KVFERRY_STEP_LIST_PIPE=0 -- --modes $M --contexts 32768,131072 --batches 1 --steps 10
kvf_e2e pipe64 -- --modes $M --contexts 32768,131072 --batches 1 --steps 10
kvf_e2e pipe32 KVFERRY_STEP_LIST_CHUNK=32 -- --modes $M --contexts 131072 --batches 1 --steps 10
kvf_e2e pipe128 KVFERRY_STEP_LIST_CHUNK=128 -- --modes $M --contexts 131072 --batches 1 --steps 10
kvf_e2e reg_b4 KVFERRY_STEP_LIST_PIPE=0 -- --modes $M --contexts 131072 --batches 4 --steps 10
kvf_e2e pipe64_b4 -- --modes $M --contexts 131072 --batches 4 --steps 10
kvf_e2e reg_drift1 KVFERRY_STEP_LIST_PIPE=0 -- --modes $M --contexts 131072 --batches 1 --steps 128 --query-drift 1.0
kvf_e2e pipe64_drift1 -- --modes $M --contexts 131072 --batches 1 --steps 128 --query-drift 1.0
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
