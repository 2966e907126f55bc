#!/usr/bin/env bash
# CPU engine on the GPU machine: kernel/pool/LFPS tests, then the CPU attention and LFPS
# benchmarks. Run from the repo root after building into build-gpu:
#   cmake --build build-gpu --target kvferry_tests cpu_attention_bench lfps_bench
#   OUT=/some/dir scripts/device/cpu.sh
# Writes $OUT/cpu_tests.json, $OUT/cpu_attention.json, $OUT/lfps.json (copies of the last two go
# to bench/results/cpu_attention_spr.json and bench/results/lfps_spr.json) and logs. About 3 min.
set -u
BUILD=${BUILD:-build-gpu}
OUT=${OUT:-bench/results}
mkdir -p "$OUT" bench/results
status=0

echo "== cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) cpus"
grep -o -w -E 'avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '
echo

echo "== tests (kernels vs reference, dense, pool, LFPS)"
timeout 90 "$BUILD/tests/kvferry_tests" \
  --gtest_filter='Cpu*:*/Cpu*:Lfps*' \
  --gtest_output="json:$OUT/cpu_tests.json" >"$OUT/cpu_tests.log" 2>&1 || status=1
grep -E '^\[  (PASSED|FAILED|SKIPPED) |tests ran' "$OUT/cpu_tests.log" | sort | uniq -c | head -40
grep -E 'Failure|FAILED' -A6 "$OUT/cpu_tests.log" | head -80

echo "== sparse/dense CPU attention throughput"
timeout 80 "$BUILD/bench/cpu_attention_bench" "$OUT/cpu_attention.json" \
  2>"$OUT/cpu_attention.log" || status=1
cat "$OUT/cpu_attention.log"
cp -f "$OUT/cpu_attention.json" bench/results/cpu_attention_spr.json 2>/dev/null

echo "== LFPS vs exact top-k, one core"
timeout 120 "$BUILD/bench/lfps_bench" "$OUT/lfps.json" 2>"$OUT/lfps.log" || status=1
cat "$OUT/lfps.log"
cp -f "$OUT/lfps.json" bench/results/lfps_spr.json 2>/dev/null
exit $status
