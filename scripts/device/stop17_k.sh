#!/usr/bin/env bash
# Stop 17, call K: xl+ around the device-selecting policies on the device (layer l takes layer
# l - 1's list of the same step, copied on the stream): the CUDA runtime and graph suites; the
# 128K x 1 point under the 8 GiB cap with xl+, psaw+ and neither; SDPA beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 150 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeTest*:*CudaGraph*:*DeviceSelected*:Prhs*' > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
rm -f $D/rows.jsonl
timeout 120 $B/bench/kvferry-e2e --steps 5 --json $D/rows.jsonl --gpu-gib 8 --contexts 131072 --batches 1 --modes quest_bank,xl+quest_bank,psaw+quest_bank,xl+psaw+quest_bank > $D/e2e.log 2>&1; echo "e2e rc=$?"
timeout 80 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/xl.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
python3 -c "
import json
for r in json.load(open('$D/xl.json'))['rows']:
    print(r['mode'], r['context'], r['batch'], r.get('skipped') or '', round(r.get('ms_per_token_step',0),3), 'ratio', round(r.get('ratio',0),3), 'capture', r.get('capture_safe'), 'syncs', r.get('host_syncs_per_step'), 'hits', r.get('rows_bank_hit_per_step'), 'fetched', r.get('rows_fetched_per_step'))"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
