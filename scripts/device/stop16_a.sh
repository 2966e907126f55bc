#!/usr/bin/env bash
# Stop 16, call A: build; GPU tests shard 0 of 2; prefill rows in chunk-major order (chunk c of
# every layer before chunk c + 1) with the next call's history prefetched and without
# (KVFERRY_PREFILL_PREFETCH=0), and layer by layer, next to torch SDPA (flash).
set -u
B=/tmp/b; D=/tmp/r; mkdir -p $D
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 -DKVFERRY_BUILD_EXAMPLES=OFF > $D/cmake.log 2>&1 || { tail -30 $D/cmake.log; exit 1; }
cmake --build $B -j16 --target kvferry_tests kvferry-e2e > $D/build.log 2>&1 || { grep -E "error|FAILED" $D/build.log | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
P="--modes prefill_dense,prefill_lfps --contexts 8192,32768,131072 --prefill-chunks 2048,8192"
timeout 120 $E $P --prefill-order chunk --json $D/rows.jsonl > $D/pf_chunk.log 2>&1; echo "chunk rc=$?"
KVFERRY_PREFILL_PREFETCH=0 timeout 120 $E $P --prefill-order chunk --json $D/nopf.jsonl > $D/pf_nopf.log 2>&1; echo "chunk nopf rc=$?"
python3 -c "
import json
for l in open('$D/nopf.jsonl'):
    r=json.loads(l); r['mode']+='_noprefetch'; print(json.dumps(r))" >> $D/rows.jsonl
timeout 120 $E $P --json $D/rows.jsonl > $D/pf_layer.log 2>&1; echo "layer rc=$?"
echo "e2e: $(( $(date +%s) - t0 )) s"
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_prefill.json > $D/sdpa.log 2>&1
python3 -c "
import json
for r in json.load(open('$D/e2e_prefill.json'))['rows']:
    print(r['mode'], r.get('order'), r['context'], r['chunk'], round(r['ms_per_layer'],2), round(r['ratio'],3), 'prime', round(r.get('ratio_with_prime',0),3), 'prefetched', r.get('chunks_prefetched'), 'h2d MB/layer', round(r.get('bytes_h2d_per_layer',0)/1e6))"
echo "sdpa: $(( $(date +%s) - t0 )) s"
left=$(( 570 - ($(date +%s) - t0) ))
GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=0 timeout $left $B/tests/kvferry_tests --gtest_brief=1 > $D/tests0.log 2>&1; echo "tests shard 0 rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests0.log | head -20
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
