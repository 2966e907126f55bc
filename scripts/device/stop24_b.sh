#!/usr/bin/env bash
# Stop 24, call B: (1) SparcasScoreQ4Kernel's grid, CTAs an SM over all items
# (KVFERRY_SPARCAS_Q4_CTAS_PER_SM 16, the old grid, against 8, 4, 2: each CTA quantizes the query
# before its rows) at 128K b1 and b4, bits=16 beside; (2) 4-bit vs 16-bit rows under a moving query
# (drift 0 and 0.5, 128 steps; stop23_drift.sh's rows); SDPA in the same call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
timeout 100 $B/tests/kvferry_tests --gtest_brief=1 --gtest_filter='*CudaEqualsHost*sparcas*' > $D/tests.log 2>&1
grep -E "^\[  (PASSED|FAILED) |Failure" $D/tests.log | head -5
rm -f $D/rows.jsonl
for c in 16 8 4 2; do
  kvf_e2e q4_sm${c}_1 KVFERRY_SPARCAS_Q4_CTAS_PER_SM=$c -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 10
done
kvf_e2e b16_1 -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 10 --param bits=16
for c in 16 4; do
  kvf_e2e q4_sm${c}_4 KVFERRY_SPARCAS_Q4_CTAS_PER_SM=$c -- --modes sparcas_bank --contexts 131072 --batches 4 --steps 10
done
echo "grid: $(( $(date +%s) - t0 )) s"
for drift in 0 0.5; do
  kvf_e2e q4_drift_$drift -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 128 --query-drift $drift
  kvf_e2e b16_drift_$drift -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 128 --query-drift $drift --param bits=16
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop24b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
cat $D/sdpa.log | tail -12
