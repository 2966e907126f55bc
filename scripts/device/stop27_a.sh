#!/usr/bin/env bash
# Stop 27, call A: KVpop selected on the device (SelectScoring::kKvpop, gpu/kvpop_select.cu).
# Build; the kvpop CUDA tests (CudaEqualsHost for kvpop with and without the bank, with the random
# MLP scorer, psaw+; the host-selecting kvpop with the bank at device=0) and the suites that list
# kvpop; memcheck and racecheck over the device kvpop tests; then e2e with keys unique: kvpop_bank
# and kvpop (no bank) at 2%, 32K and 128K, b1 and b4, hip_bank and sparcas_bank beside them, and
# torch SDPA in the same call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='*CudaEqualsHost/*kvpop*:*DeviceSelected*:*CudaStepBank*:*CudaBankPressure*:*HostListBank*:*Kvpop*:*Batch16*:*GpuBytesCap*'
timeout 120 $T --gtest_brief=1 --gtest_filter="$F" > $D/t_kvpop.log 2>&1
echo "== t_kvpop"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/t_kvpop.log | head -12
K='*CudaEqualsHost/*kvpop*'
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="$K" > $D/memcheck.log 2>&1
echo "== memcheck"; grep -E "^\[  (PASSED|FAILED) |ERROR SUMMARY" $D/memcheck.log | head -4
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter="*CudaEqualsHost/*kvpop_mlp*" > $D/racecheck.log 2>&1
echo "== racecheck"; grep -E "^\[  (PASSED|FAILED) |RACECHECK SUMMARY" $D/racecheck.log | head -4
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e a_128k -- --modes kvpop_bank,kvpop,hip_bank,sparcas_bank --contexts 131072 --batches 1,4 --steps 16 $U
kvf_e2e a_32k -- --modes kvpop_bank,kvpop --contexts 32768 --batches 1 --steps 16 $U
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop27a.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -3 $D/sdpa.log
