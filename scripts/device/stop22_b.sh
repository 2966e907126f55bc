#!/usr/bin/env bash
# Stop 22, call B: stop22_a's query-drift rows failed (kvferry-e2e sized the sequences for 2 x steps
# past the context, its runs take 3 x steps + 7: fixed). (1) The moving-query rows: sparcas_bank and
# quest_bank at 128K, drift 0 / 0.5 / 1.0, 128 steps; SDPA in the same call. (2) ncu (no nsys on
# this machine): each kernel's duration over sparcas_bank at 32K and 128K, batch 1, one step a run
# (kernels serialised), to split a layer's fixed cost from its context-bound cost.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
for drift in 0 0.5 1.0; do
  kvf_e2e drift_$drift -- --modes sparcas_bank,quest_bank --contexts 131072 \
    --batches 1 --steps 128 --query-drift $drift
done
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_drift.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
NCU=/usr/local/cuda/bin/ncu
for c in 32768 131072; do
  timeout 150 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --launch-skip 0 --launch-count 12000 --log-file $D/ncu_sparcas_$c.csv \
    $E --modes sparcas_bank --contexts $c --batches 1 --steps 1 --json $D/ncu_$c.jsonl > $D/ncu_$c.log 2>&1
  echo "ncu $c rc=$? lines=$(wc -l < $D/ncu_sparcas_$c.csv)"
done
gzip -f $D/ncu_*.csv
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
