#!/usr/bin/env bash
# Stop 30, call C: the scale table's dense figure under the same 8 GiB cap (issue 14: "against the
# largest dense batch that fits the same cap"): dense_resident (every KV row on the GPU, the
# window covering the context) at 32K x 1, 48K x 1, 56K x 1, 32K x 2 and 128K x 1 under
# --gpu-gib 8 (the runtime refuses what does not fit; its message is the row), SDPA uncapped at
# the same points. Then where the multi-CTA top-k's ~50 us a layer go: ncu of sparcas_bank at
# 128K b1 with KVFERRY_MCTA_FUSED=0 (one launch a pass; ncu_sum.py per kernel). Into $OUT/r.tgz.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
kvf_e2e dense_b1 -- --modes dense_resident --contexts 32768,49152,57344,131072 --batches 1 --steps 8 --gpu-gib 8 --device-gib 120
kvf_e2e dense_b2 -- --modes dense_resident --contexts 32768 --batches 2 --steps 8 --gpu-gib 8 --device-gib 120
grep -o '"context":[0-9]*\|"batch":[0-9]*\|"skipped":"[^"]*"\|"gpu_bytes":[0-9]*' $D/dense_b*.jsonl | paste - - - | head
timeout 150 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/sdpa_dense.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -6 $D/sdpa.log
NCU=/usr/local/cuda/bin/ncu
KVFERRY_MCTA_FUSED=0 timeout 220 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
  --launch-skip 0 --launch-count 20000 --log-file $D/ncu_sparcas_perpass.csv \
  $B/bench/kvferry-e2e --modes sparcas_bank --contexts 131072 --batches 1 --steps 1 --unique-kv \
  --json $D/ncu_sparcas_perpass.jsonl > $D/ncu.log 2>&1
echo "ncu rc=$? lines=$(wc -l < $D/ncu_sparcas_perpass.csv)"
python3 scripts/device/ncu_sum.py $D/ncu_sparcas_perpass.csv 32 | tee $D/ncu_sparcas_perpass.sum.txt | tail -16
gzip -f $D/ncu_*.csv
