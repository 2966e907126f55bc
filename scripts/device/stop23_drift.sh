#!/usr/bin/env bash
# Ready for a GPU call after stop23_check.sh (written in stop 23, not yet run): what SparCas's
# 4-bit rows cost and save with a moving query. On the real SmolLM2 trace their selections follow
# the query more closely (recall 0.747 against 0.653) and hit the bank less (0.870 / 0.915 against
# 0.93 / 0.95 at 512 / 1024 slots), so the misses, read zero-copy, may grow. sparcas_bank at 128K
# batch 1, 128 timed steps, query drift 0 and 0.5, at 4 bits (the default) and 16 bits (the
# paper's rows); the bank's hit rate and the selection's own time in each row.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
for drift in 0 0.5; do
  kvf_e2e q4_drift_$drift -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 128 \
    --query-drift $drift
  kvf_e2e b16_drift_$drift -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 128 \
    --query-drift $drift --param bits=16
done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
