#!/usr/bin/env bash
# Stop 29, call A (written in stop 28 without device time left; the next session's first call).
# Issue 14's scale points under an 8 GiB cap with stop 28's admission beside the next layer, and
# the baselines the scale table's newer rows lack, in one call: at 128K x 4 (host store 64 GiB)
# kvpop_bank, kvpop_bank with PrHS's selectors (psaw+, xl+), full_streaming (every row over PCIe)
# and dense_cpu (every row on the 16 cores); torch SDPA uncapped. 32K x 16 is call B (the same
# modes; the fills alone take about 40 s a mode). Keys unique.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
U=--unique-kv
P=${POINT:-128k4}
case $P in
  128k4) C=131072; N=4 ;;
  32k16) C=32768; N=16 ;;
esac
kvf_e2e a_cap$P -- --modes kvpop_bank,psaw+kvpop_bank,xl+kvpop_bank --contexts $C --batches $N --steps 8 $U --gpu-gib 8 --host-gib 110
kvf_e2e a_base$P -- --modes full_streaming,dense_cpu --contexts $C --batches $N --steps 2 $U --gpu-gib 8 --host-gib 110
timeout 150 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop29a_$P.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -6 $D/sdpa.log
