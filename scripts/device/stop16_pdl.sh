#!/usr/bin/env bash
# Stop 16: the decode step kernel launched with programmatic dependent launch (L2 warmed before
# griddepcontrol.wait) and its combine with 16 float4 loads in flight per thread, against
# KVFERRY_STEP_PDL=0 in the same run, dense all-resident rows next to torch SDPA; then the decode
# step's GPU tests.
set -u
B=/tmp/b; D=/tmp/r; mkdir -p $D
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 -DKVFERRY_BUILD_EXAMPLES=OFF > $D/cmake.log 2>&1 || { tail -30 $D/cmake.log; exit 1; }
cmake --build $B -j16 --target kvferry_tests kvferry-e2e > $D/build.log 2>&1 || { grep -E "error|FAILED" $D/build.log | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
for pdl in 0 1; do
  for cb in ${CB:-32768:1 32768:4 131072:1}; do
    c=${cb%:*}; b=${cb#*:}
    KVFERRY_STEP_PDL=$pdl timeout 100 $E --modes dense_resident --contexts $c --batches $b --steps 10 --json $D/pdl$pdl.jsonl > $D/pdl${pdl}_${c}_${b}.log 2>&1 || echo "e2e $pdl $c $b failed"
  done
  python3 -c "
import json
for l in open('$D/pdl$pdl.jsonl'):
    r=json.loads(l); r['mode']+=('_pdl' if $pdl else '_nopdl'); print(json.dumps(r))" >> $D/rows.jsonl
done
echo "e2e: $(( $(date +%s) - t0 )) s"
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_pdl.json > $D/sdpa.log 2>&1; tail -8 $D/sdpa.log
echo "sdpa: $(( $(date +%s) - t0 )) s"
left=$(( 560 - ($(date +%s) - t0) ))
timeout $left $B/tests/kvferry_tests --gtest_brief=1 --gtest_filter="${TF:-*CudaRuntimeTest*:*CudaGraph*:*CudaPlannedStep*:*CudaStepBank*:*CudaRuntimeLong*}" > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -20
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
