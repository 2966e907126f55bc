#!/usr/bin/env bash
# Stop 41, call A: the scheduler's split of a device selection's misses between PCIe and the CPU
# (route auto, no bank: SplitStepList, the CPU share on the runtime's thread, the merge on the
# stream). The split's CUDA tests (rule on random lists, outputs vs route gpu, faults), the
# planned-step suites around it, memcheck; e2e at 128K b1 and b4 (keys unique, 2%) of sparcas and
# kvpop on route gpu, auto (the cost model's share) and auto with every miss on the CPU
# (KVFERRY_SPLIT_SHARE=1), with the probed rates, in one call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='SplitStepList.*:SchedulerSplit.*:*FaultsSplit*:CostModel.*:PlannedStep.*:*DeviceSelected*:AsyncCpuPart.*:*CudaGraph*:*CudaRuntimeLong*:*CudaEqualsHost/*'
timeout 200 $T --gtest_brief=1 --gtest_filter="$F" > $D/a_t.log 2>&1
echo "== a_t rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/a_t.log | head -16
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" $D/a_t.log > $D/a_t.summary.txt
timeout 90 compute-sanitizer --tool memcheck $T --gtest_brief=1 \
  --gtest_filter='SplitStepList.*:*FaultsSplit/*decode_before_cuda*' > $D/a_memcheck.log 2>&1
echo "== memcheck rc=$?"; grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) " $D/a_memcheck.log | tee $D/a_memcheck.summary.txt
rm -f $D/rows.jsonl
U=--unique-kv
for b in 1 4; do
  kvf_e2e gpu_b$b -- --modes sparcas,kvpop --contexts 131072 --batches $b --steps 8 $U --route gpu
  kvf_e2e auto_b$b -- --modes sparcas,kvpop --contexts 131072 --batches $b --steps 8 $U --route auto
  kvf_e2e cpu_b$b KVFERRY_SPLIT_SHARE=1 -- --modes sparcas,kvpop --contexts 131072 --batches $b --steps 8 $U --route auto
done
python3 - $D/rows.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r.get("variant"), r.get("mode"), "b%s" % r.get("batch"), "graph %.3f" % r.get("ms_per_token_step", -1),
          "no_graph %.3f" % r.get("ms_per_token_step_no_graph", -1), "split/step", r.get("decode_split_per_step"),
          "rows_cpu", r.get("rows_cpu_per_step"), "cpu_gbps %.1f/%.1f" % (r.get("cost_cpu_gbps", 0), r.get("cost_cpu_gbps_measured", 0)),
          "pcie %.1f" % r.get("cost_pcie_gbps", 0), r.get("skipped", ""))
PY
