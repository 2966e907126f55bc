#!/usr/bin/env bash
# The moving-query measurement (written in stop 21; run as stop22_b.sh's first part, rows in
# e2e_h100.json run '2026-11-28 stop 22 moving query'): sparcas_bank and quest_bank at 128K
# (2%, 32 layers, batch 1) with the decode query fixed (--query-drift 0, as every earlier row) and
# moving (0.5, 1.0), 128 timed steps so that SparCas's every-64-steps refresh falls inside them;
# the selection timed alone and the bank's hits per step in each row; SDPA in the same call.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
for drift in 0 0.5 1.0; do
  kvf_e2e drift_$drift -- --modes sparcas_bank,quest_bank --contexts 131072 \
    --batches 1 --steps 128 --query-drift $drift
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_drift.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
