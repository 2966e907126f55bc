#!/usr/bin/env bash
# Stop 28, call A (right after stop27_e, the build still warm): where sparcas_bank's and
# hip_bank's token step goes at 128K b1 on the H200. ncu, each kernel's duration (kernels
# serialised, clocks free), one timed step a run; scripts/device/ncu_sum.py sums them by kernel.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
NCU=/usr/local/cuda/bin/ncu
for m in sparcas_bank hip_bank; do
  timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --launch-skip 0 --launch-count 20000 --log-file $D/ncu_$m.csv \
    $E --modes $m --contexts 131072 --batches 1 --steps 1 --unique-kv --json $D/ncu_$m.jsonl > $D/ncu_$m.log 2>&1
  echo "ncu $m rc=$? lines=$(wc -l < $D/ncu_$m.csv)"
  python3 scripts/device/ncu_sum.py $D/ncu_$m.csv 32 | tee $D/ncu_$m.sum.txt
done
gzip -f $D/ncu_*.csv
