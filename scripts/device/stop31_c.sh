#!/usr/bin/env bash
# Stop 31, call C: xl+ at its sharing layers ranks nothing (DecodeStepArgs::select_skip_ranking:
# quest's bounds and sparcas's compact rows kept current, the previous layer's list copied). The
# xl / equals-host / graph / bank / long-runtime CUDA tests and memcheck over the xl ones; e2e
# (keys unique, 2%) at 128K b1: sparcas, quest, kvpop (no skip: its slots are state) with and
# without xl+, and sparcas with and without xl+ at b4, in one call with torch SDPA.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='*CudaEqualsHost/*xl*:*DeviceSelected*xl*:*XlSharing*:*CudaGraph*:CudaStepBank.*:*CudaRuntimeLong*:*CudaEqualsHost/*sparcas*:*CudaEqualsHost/*quest*'
timeout 240 $T --gtest_brief=1 --gtest_filter="$F" > $D/c_t.log 2>&1
echo "== c_t rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/c_t.log | head -12
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" $D/c_t.log > $D/c_t.summary.txt
timeout 120 compute-sanitizer --tool memcheck $T --gtest_brief=1 \
  --gtest_filter='*CudaEqualsHost/*xl*:*DeviceSelected*xl*' > $D/c_memcheck.log 2>&1
echo "== memcheck rc=$?"; grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) " $D/c_memcheck.log | tee $D/c_memcheck.summary.txt
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e c_128k -- --modes sparcas_bank,xl+sparcas_bank,quest_bank,xl+quest_bank,kvpop_bank,xl+kvpop_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e c_128k4 -- --modes sparcas_bank,xl+sparcas_bank --contexts 131072 --batches 4 --steps 16 $U
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop31c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -8 $D/sdpa.log
