#!/usr/bin/env bash
# Stop 22, call A: (1) the GPU check owed by stop 21's review mend (host-side timing only):
# long-runtime, graph and top-k tests; (2) where a sparse layer's time goes inside the CUDA graph:
# nsys with --cuda-graph-trace=node over sparcas_bank and quest_bank at 32K and 128K (batch 1),
# every kernel's start and end as CSV (the per-layer chain, gaps included); (3) the moving-query
# rows (scripts/device/query_drift.sh's: drift 0 / 0.5 / 1.0 at 128K, 128 steps) with SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
PATH=$PATH:/usr/local/cuda/bin
timeout 200 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*:*CudaGraph*:*SelectTopK*' > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
echo "tests: $(( $(date +%s) - t0 )) s"
if command -v nsys > /dev/null; then
  for m in sparcas_bank quest_bank; do for c in 32768 131072; do
    timeout 150 nsys profile --cuda-graph-trace=node -o $D/p_${m}_$c --force-overwrite true \
      $E --modes $m --contexts $c --batches 1 --steps 4 --json $D/nsys_${m}_$c.jsonl > $D/nsys_${m}_$c.log 2>&1
    timeout 90 nsys stats --report cuda_gpu_trace --format csv -o $D/k_${m}_$c $D/p_${m}_$c.nsys-rep > /dev/null 2>&1
    rm -f $D/p_${m}_$c.nsys-rep $D/p_${m}_$c.sqlite
    ls $D/k_${m}_$c* 2>/dev/null | head -2
  done; done
else echo "no nsys"; fi
echo "nsys: $(( $(date +%s) - t0 )) s"
rm -f $D/rows.jsonl
for drift in 0 0.5 1.0; do
  kvf_e2e drift_$drift -- --modes sparcas_bank,quest_bank --contexts 131072 \
    --batches 1 --steps 128 --query-drift $drift
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_drift.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
gzip -f $D/k_*.csv 2>/dev/null
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
