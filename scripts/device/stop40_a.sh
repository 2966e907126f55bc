#!/usr/bin/env bash
# Stop 40, call A: the cost model's device rates in Stats (cost_hbm_gbps / cost_h2d_gbps probed
# at Create; ms_attend_device and cost_select_gbps_measured / cost_attend_gbps_measured from the
# calls Runtime::TimeDeviceSelect times). The cost-model, timing, graph, bank and long-runtime
# CUDA tests, memcheck over the timed ones; e2e (keys unique, 2%) at 128K b1 and b4 for the GPU
# policies with the new fields, in one call with torch SDPA.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='CostModel.*:PlannedStep.*:*TimeDevice*:*CudaGraph*:CudaStepBank.*:*CudaRuntimeLong*:*CudaEqualsHost/*sparcas*:*CudaEqualsHost/*hip*:*CudaEqualsHost/*kvpop*'
timeout 240 $T --gtest_brief=1 --gtest_filter="$F" > $D/a_t.log 2>&1
echo "== a_t rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/a_t.log | head -12
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" $D/a_t.log > $D/a_t.summary.txt
timeout 120 compute-sanitizer --tool memcheck $T --gtest_brief=1 \
  --gtest_filter='CostModel.*:*CudaRuntimeLong*' > $D/a_memcheck.log 2>&1
echo "== memcheck rc=$?"; grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) " $D/a_memcheck.log | tee $D/a_memcheck.summary.txt
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e a_128k -- --modes sparcas_bank,hip_bank,quest_bank,kvpop_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e a_128k4 -- --modes sparcas_bank,hip_bank,kvpop_bank --contexts 131072 --batches 4 --steps 16 $U
grep -o '"mode":"[a-z_+]*"\|"batch":[0-9]*\|"ms_select_device_per_step":[0-9.e-]*\|"ms_attend_device_per_step":[0-9.e-]*\|"cost_[a-z_]*":[0-9.e+-]*' $D/rows.jsonl | tr '\n' ' '; echo
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop40a.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -8 $D/sdpa.log
