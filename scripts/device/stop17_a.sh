#!/usr/bin/env bash
# Stop 17, call A (branch wip/async-write-through rebased on main): build; the prefill rows with the
# write-through on the copy engines and, in the same run, with the stage kernel's zero-copy stores
# (KVFERRY_PREFILL_WRITE=zero-copy); SDPA beside them; then the prefill, cap and decode-step suites.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl $D/zc.jsonl
P="--modes prefill_dense --contexts 8192,32768 --prefill-chunks 2048,8192"
for order in chunk layer; do
  timeout 100 $E $P --prefill-order $order --json $D/rows.jsonl > $D/pf_$order.log 2>&1; echo "$order rc=$?"
  KVFERRY_PREFILL_WRITE=zero-copy timeout 100 $E $P --prefill-order $order --json $D/zc.jsonl > $D/pf_zc_$order.log 2>&1; echo "$order zero-copy rc=$?"
done
timeout 120 $E --modes prefill_dense,prefill_lfps --contexts 131072 --prefill-chunks 2048,8192 --prefill-order chunk --json $D/rows.jsonl > $D/pf_128k.log 2>&1; echo "128k rc=$?"
timeout 60 $E --modes prefill_lfps --contexts 8192,32768 --prefill-chunks 2048,8192 --prefill-order chunk --json $D/rows.jsonl > $D/pf_lfps.log 2>&1; echo "lfps rc=$?"
python3 -c "
import json
for l in open('$D/zc.jsonl'):
    r=json.loads(l); r['mode']+='_zerocopy_write'; print(json.dumps(r))" >> $D/rows.jsonl
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_wt.json > $D/sdpa.log 2>&1; tail -40 $D/sdpa.log
timeout 150 $B/tests/kvferry_tests --gtest_brief=1 --gtest_filter='*CudaPrefill*:*LfpsPrime*:*GpuBytesCap*:*CudaRuntimeTest*:*CudaGraph*:*CudaPlannedStep*:*CudaStepBank*' > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
