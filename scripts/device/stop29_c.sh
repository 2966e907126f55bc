#!/usr/bin/env bash
# Stop 29, call C: the new CUDA test (its prompts fixed to one prefill chunk) with memcheck; then
# lfps at 128K b1 (2%, route auto: the planned CPU step, LFPS's scan on the device) with the CPU
# part on the runtime's thread (async_cpu 1) and on the caller's (0), each without and with
# 300 us of the engine's own host work after every Decode (--engine-us); torch SDPA in the same
# call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 60 $T --gtest_filter='CudaCpuPart.*' > $D/t.log 2>&1
echo "test rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|FAILED|Actual|Expected|rror" $D/t.log | head -20
timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter='CudaCpuPart.*' > $D/memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E "^\[  (PASSED|FAILED) |ERROR SUMMARY" $D/memcheck.log
rm -f $D/rows.jsonl
for e in 0 300; do
  for a in 1 0; do
    kvf_e2e c_async${a}_e$e -- --modes lfps --contexts 131072 --batches 1 --steps 8 --async-cpu $a --engine-us $e
    grep -o '"ms_in_decode_per_step":[0-9.]*' $D/c_async${a}_e$e.jsonl
  done
done
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop29c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -5 $D/sdpa.log
