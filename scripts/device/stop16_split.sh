#!/usr/bin/env bash
# Stop 16: the dense all-resident step's split count (KVFERRY_STEP_CTAS_PER_SM x KVFERRY_STEP_WAVES
# CTAs per SM of splits) through kvferry-e2e, then racecheck of single small cases of the prime,
# prefill and select kernels.
set -u
B=/tmp/b; D=/tmp/r; mkdir -p $D
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 -DKVFERRY_BUILD_EXAMPLES=OFF > $D/cmake.log 2>&1 || { tail -30 $D/cmake.log; exit 1; }
cmake --build $B -j16 --target kvferry_tests kvferry-e2e > $D/build.log 2>&1 || { grep -E "error|FAILED" $D/build.log | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
E=$B/bench/kvferry-e2e
for cfg in 2:1 1:1 3:1 1:2 2:2 1:4 2:4 ${EXTRA:-}; do
  cps=${cfg%:*}; w=${cfg#*:}
  KVFERRY_STEP_CTAS_PER_SM=$cps KVFERRY_STEP_WAVES=$w timeout 60 $E --modes dense_resident --contexts 32768 --batches 1 --steps 10 --json $D/split_${cps}_${w}.jsonl > $D/split_${cps}_${w}.log 2>&1
  python3 -c "
import json
for l in open('$D/split_${cps}_${w}.jsonl'):
    r=json.loads(l); print('cps $cps waves $w', r['context'], r['batch'], round(r['ms_per_token_step'],4))"
done
echo "splits: $(( $(date +%s) - t0 )) s"
PATH=$PATH:/usr/local/cuda/bin
for f in '*LfpsPrimeTest.CudaKernelEqualsReference/n97_sink4_g4_d128_bf16_chunk40' '*GpuPrefillTest.MatchesScalarReference/q97_pos257_g4_d128' '*GpuSelectTopKTest.BothPathsEqualTheHostReference/0'; do
  n=$(echo "$f" | tr -c 'a-zA-Z0-9\n' '_' | cut -c1-60)
  timeout 100 compute-sanitizer --tool racecheck --racecheck-report hazard $B/tests/kvferry_tests --gtest_brief=1 --gtest_filter="$f" > $D/race_$n.txt 2>&1; echo "racecheck $f rc=$?"
  grep -E "tests ran|PASSED|FAILED|ERROR SUMMARY|RACECHECK SUMMARY|Error" $D/race_$n.txt | head -4
done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
