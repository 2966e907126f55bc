#!/usr/bin/env bash
# Stop 17, call I: psaw+ around the device-selecting policies on the device (the list filtered by
# PsawFilterKernel): the CUDA-vs-host runtime tests, the captured-step tests, memcheck over the psaw
# cases; then the 128K x 1 point under the 8 GiB cap with and without psaw+ (and the 32K point
# without the bank), SDPA beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 200 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeTest*:*CudaGraph*:*DeviceSelected*:Prhs*' > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeTest*psaw*' > $D/memcheck.log 2>&1; echo "memcheck rc=$?"
grep -E "^\[  (PASSED|FAILED) |ERROR SUMMARY" $D/memcheck.log | head -4
E="$B/bench/kvferry-e2e --steps 5 --json $D/rows.jsonl"
rm -f $D/rows.jsonl
timeout 150 $E --gpu-gib 8 --contexts 131072 --batches 1 --modes quest_bank,psaw+quest_bank,psaw+oracle_bank,psaw+sparcas_bank > $D/e2e.log 2>&1; echo "e2e 128K rc=$?"
timeout 60 $E --contexts 32768 --batches 1 --modes quest,psaw+quest > $D/e2e32.log 2>&1; echo "e2e 32K rc=$?"
timeout 90 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/psaw.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
python3 -c "
import json
for r in json.load(open('$D/psaw.json'))['rows']:
    print(r['mode'], r['context'], r['batch'], r.get('skipped') or '', round(r.get('ms_per_token_step',0),3), 'ratio', round(r.get('ratio',0),3), 'capture', r.get('capture_safe'), 'syncs', r.get('host_syncs_per_step'), 'h2d MB', round(r.get('bytes_h2d_per_step',0)/1e6,2), 'hits', r.get('rows_bank_hit_per_step'), 'fetched', r.get('rows_fetched_per_step'))"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
