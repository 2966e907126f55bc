#!/usr/bin/env bash
# Stop 21, call E: review mends on the GPU side (the multi-CTA passes' tile loads through one
# LoadTile helper; the launchers' measuring knobs through EnvInt). The selection, long-runtime,
# graph, step-bank and SparCas CUDA tests; then sparcas_bank and quest_bank at 128K (2%, 32 layers,
# batch 1) against call C's 4.59 / 4.11 ms. Results straight under $OUT (a cut call keeps them).
set -u
D=$OUT/r
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='*SelectTopK*:*SelectMcta*:*CudaRuntimeLong*:*CudaGraph*:*CudaStepBank*:*Sparcas*Cuda*:EnvInt*'
timeout 100 $T --gtest_brief=1 --gtest_filter="$F" > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
timeout 60 $B/bench/kvferry-e2e --modes sparcas_bank,quest_bank --contexts 131072 --batches 1 --steps 10 --json $D/e2e.jsonl > $D/e2e.log 2>&1
echo "e2e rc=$? $(grep -o '"mode":"[a-z_]*"\|"ms_per_token_step":[0-9.]*\|"ms_select_device_per_step":[0-9.]*' $D/e2e.jsonl | tr '\n' ' ')"
echo "total: $(( $(date +%s) - t0 )) s"
