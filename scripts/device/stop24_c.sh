#!/usr/bin/env bash
# Stop 24, call C: SparCas's 4-bit scoring folds the top-k's softmax statistics in (each scoring
# CTA's (max, sum) a head into the multi-CTA scratch, histograms zeroed there; the fused top-k
# skips its statistics pass and barrier, its weights pass merges up to 512 partials with block
# reductions):
#  - CudaRuntimeLong (multi-CTA selection == host, exact lists) with the fold (default), with the
#    per-pass launches (KVFERRY_MCTA_FUSED=0) and without the fold (KVFERRY_SPARCAS_SCORE_STATS=0);
#    the top-k and CUDA-vs-host sparcas tests; memcheck over CudaRuntimeLong;
#  - e2e A/B in one call: fold on / off at 128K b1 and b4, quest_bank b1 (its weights pass merge
#    changed too), SDPA beside.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 120 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*:*CudaEqualsHost*sparcas*:*SelectTopK*:*Mcta*' > $D/t_default.log 2>&1 &
KVFERRY_MCTA_FUSED=0 timeout 120 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*' > $D/t_perpass.log 2>&1 &
KVFERRY_SPARCAS_SCORE_STATS=0 timeout 120 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*' > $D/t_nofold.log 2>&1 &
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 \
  --gtest_filter='*CudaRuntimeLong*sparcas*' > $D/memcheck.log 2>&1 &
wait
for f in t_default t_perpass t_nofold memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -8
done
echo "tests: $(( $(date +%s) - t0 )) s"
rm -f $D/rows.jsonl
kvf_e2e fold_1 -- --modes sparcas_bank,quest_bank --contexts 131072 --batches 1 --steps 10
kvf_e2e nofold_1 KVFERRY_SPARCAS_SCORE_STATS=0 -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 10
kvf_e2e fold_4 -- --modes sparcas_bank --contexts 131072 --batches 4 --steps 10
kvf_e2e nofold_4 KVFERRY_SPARCAS_SCORE_STATS=0 -- --modes sparcas_bank --contexts 131072 --batches 4 --steps 10
timeout 80 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop24c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -6 $D/sdpa.log
