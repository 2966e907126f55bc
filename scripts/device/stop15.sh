#!/usr/bin/env bash
# Stop 15 on the GPU machine: build, the whole GPU test suite, then the e2e rows of this stop in
# one run next to torch SDPA: prefill (dense and lfps, 32K, chunks 2K/8K; the history re-staged
# every chunk, KVFERRY_PREFILL_RESTAGE=1, and LFPS primed every chunk, KVFERRY_PRIME_EAGER=1, as
# the before rows), and the decode rows of dense all-resident and lfps at 32K/64K.
set -u
B=/tmp/b; D=/tmp/r4; mkdir -p $D
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 -DKVFERRY_BUILD_EXAMPLES=OFF > $D/cmake.log 2>&1 || { tail -30 $D/cmake.log; exit 1; }
cmake --build $B -j16 --target kvferry_tests kvferry-e2e > $D/build.log 2>&1 || { grep -E "error|FAILED" $D/build.log | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
timeout ${TEST_T:-300} $B/tests/kvferry_tests --gtest_brief=1 ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -20
E=$B/bench/kvferry-e2e
timeout 120 $E --modes prefill_dense,prefill_lfps --contexts 32768 --prefill-chunks 2048,8192 --json $D/rows.jsonl > $D/pf.log 2>&1; echo "prefill rc=$?"
KVFERRY_PREFILL_RESTAGE=1 KVFERRY_PRIME_EAGER=1 timeout 120 $E --modes prefill_dense,prefill_lfps --contexts 32768 --prefill-chunks 2048 --json $D/before.jsonl > $D/pf_before.log 2>&1; echo "prefill before rc=$?"
python3 -c "
import json,sys
for l in open('$D/before.jsonl'):
    r=json.loads(l); r['mode']+='_before'; print(json.dumps(r))" >> $D/rows.jsonl
timeout 150 $E --modes dense_resident,lfps --contexts 32768,65536 --batches 1 --steps 8 --json $D/rows.jsonl > $D/dec.log 2>&1; echo "decode rc=$?"
python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop15.json > $D/sdpa.log 2>&1; tail -10 $D/sdpa.log
cp $D/e2e_stop15.json $D/tests.log $OUT/ ; tar czf $OUT/r4.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
