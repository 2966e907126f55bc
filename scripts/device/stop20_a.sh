#!/usr/bin/env bash
# Stop 20, call A: where a device-selected layer step goes at 128K. sparcas_bank and quest_bank at
# 2% (32 layers, batch 1) timed plainly, then the same under ncu (one metric: each kernel's
# duration, kernels serialised) to list the kernels of one token step and their times.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout 120 $E --modes sparcas_bank,quest_bank --contexts 131072 --batches 1 --steps 10 --json $D/plain.jsonl > $D/plain.log 2>&1
echo "plain rc=$? $(grep -o '"mode":"[a-z_]*"\|"ms_per_token_step":[0-9.]*' $D/plain.jsonl | tr '\n' ' ')"
for m in sparcas_bank quest_bank; do
  timeout 240 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --launch-skip 0 --launch-count 12000 --log-file $D/ncu_$m.csv \
    $E --modes $m --contexts 131072 --batches 1 --steps 1 --json $D/ncu_$m.jsonl > $D/ncu_$m.log 2>&1
  echo "ncu $m rc=$? lines=$(wc -l < $D/ncu_$m.csv)"
done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
