#!/usr/bin/env bash
# Branch wip/async-write-through (not yet run on the GPU): the prefill chunk's write-through by
# the copy engines from the staging while the chunk is attended, against the stage kernel's
# zero-copy stores (KVFERRY_PREFILL_WRITE=zero-copy) in the same run; then the tests it touches.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
P="--modes prefill_dense,prefill_lfps --contexts 8192,32768,131072 --prefill-chunks 2048,8192"
for order in layer chunk; do
  timeout 120 $E $P --prefill-order $order --json $D/rows.jsonl > $D/pf_$order.log 2>&1; echo "$order rc=$?"
  KVFERRY_PREFILL_WRITE=zero-copy timeout 120 $E $P --prefill-order $order --json $D/zc.jsonl > $D/pf_zc_$order.log 2>&1; echo "$order zero-copy rc=$?"
done
python3 -c "
import json
for l in open('$D/zc.jsonl'):
    r=json.loads(l); r['mode']+='_zerocopy_write'; print(json.dumps(r))" >> $D/rows.jsonl
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_wt.json > $D/sdpa.log 2>&1; tail -30 $D/sdpa.log
timeout 200 $B/tests/kvferry_tests --gtest_brief=1 --gtest_filter='*CudaPrefill*:*LfpsPrime*:*GpuBytesCap*:*Cuda*Fault*:*FaultMatrix*' > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
