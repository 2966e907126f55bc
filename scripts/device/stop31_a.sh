#!/usr/bin/env bash
# Stop 31, call A: SparCas's 4-bit layers without the logit round trip (the fused multi-CTA top-k
# computes its items' logits from the 4-bit rows; SparcasScoreQ4Kernel skips those items). The
# select, long-runtime, graph and equals-host CUDA tests for sparcas and hip, memcheck over the
# long runtime; e2e (keys unique, 2%) sparcas_bank and hip_bank at 128K b1 and b4 with the fused
# scoring (default) and without (KVFERRY_SPARCAS_FUSED_SCORE=0), in one call with torch SDPA.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='*CudaRuntimeLong*:*SelectTopK*:*Mcta*:*CudaGraph*:*CudaEqualsHost/*sparcas*:*CudaEqualsHost/*hip*:*DeviceSelected*sparcas*:*DeviceSelected*hip*:CudaStepBank.*'
timeout 240 $T --gtest_brief=1 --gtest_filter="$F" > $D/a_t.log 2>&1
echo "== a_t rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/a_t.log | head -12
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" $D/a_t.log > $D/a_t.summary.txt
timeout 150 compute-sanitizer --tool memcheck $T --gtest_brief=1 \
  --gtest_filter='*CudaRuntimeLong*sparcas*:*CudaRuntimeLong*hip*' > $D/a_memcheck.log 2>&1
echo "== memcheck rc=$?"; grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) " $D/a_memcheck.log | tee $D/a_memcheck.summary.txt
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e a_128k -- --modes sparcas_bank,hip_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e a_128k_old KVFERRY_SPARCAS_FUSED_SCORE=0 -- --modes sparcas_bank,hip_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e a_128k4 -- --modes sparcas_bank --contexts 131072 --batches 4 --steps 16 $U
kvf_e2e a_128k4_old KVFERRY_SPARCAS_FUSED_SCORE=0 -- --modes sparcas_bank --contexts 131072 --batches 4 --steps 16 $U
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop31a.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -8 $D/sdpa.log
