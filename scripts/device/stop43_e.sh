#!/usr/bin/env bash
# Stop 43, call E: RuntimeConfig::xl_prefetch = -1 (auto: prefetch while the measured stream time
# between layers' Decode calls averages >= 100 us). Its tests on CUDA (the prefetch suites, the
# auto test on the posing device, faults, graphs), then kvferry-e2e at 128K b1 with the default
# (auto) in the attention-only loop and with 150 us of engine GPU work a layer: the rows carry
# xl_gap_us and whether the steps prefetched.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
F='HostListBank.*:CudaStepBank.*:PrefetchListRows.*:*FaultsXlPrefetch*:*CudaGraph*:PlannedStep.*'
timeout 150 $T --gtest_brief=1 --gtest_filter="$F" > $D/e_t.log 2>&1
echo "== e_t rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/e_t.log | head -16
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" $D/e_t.log > $D/e_t.summary.txt
rm -f $D/rows.jsonl
U="--unique-kv --query-drift 0.5 --steps 12 --contexts 131072 --batches 1"
kvf_e2e auto_e0 -- --modes xl+sparcas_bank,xl+kvpop_bank $U
kvf_e2e auto_e150 -- --modes xl+sparcas_bank,xl+kvpop_bank $U --engine-gpu-us 150
python3 - $D/rows.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r.get("variant"), r.get("mode"), "eng", r.get("engine_gpu_us"), "graph %.3f" % r.get("ms_per_token_step", -1),
          "no_graph %.3f" % r.get("ms_per_token_step_no_graph", -1), "prefetched/step", r.get("decode_prefetched_per_step"),
          "xl_gap_us", r.get("xl_gap_us"))
PY
