#!/usr/bin/env bash
# Stop 30, call B: the scale table's single-GPU points under the 8 GiB cap, each with its
# baselines and torch SDPA uncapped in the same call: 512K x 1 (host store 64 GiB), 128K x 1 and
# 32K x 4; kvpop_bank with and without PrHS's selectors (psaw+, xl+), full_streaming (every row
# over PCIe) and dense_cpu (every row on the 16 cores). Keys unique. Also SDPA at 32K x 16 for
# stop30_a's rows (bench/results/stop30/s32k16.jsonl). Results tarred into $OUT/r.tgz.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
U=--unique-kv
point() {  # point NAME CONTEXT BATCH
  local n=$1 c=$2 b=$3
  rm -f $D/rows.jsonl
  kvf_e2e ${n}_cap -- --modes kvpop_bank,psaw+kvpop_bank,xl+kvpop_bank --contexts $c --batches $b --steps 8 $U --gpu-gib 8 --host-gib 110
  kvf_e2e ${n}_base -- --modes full_streaming,dense_cpu --contexts $c --batches $b --steps 2 $U --gpu-gib 8 --host-gib 110
  mv $D/rows.jsonl $D/rows_$n.jsonl
  timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows_$n.jsonl $D/sdpa_$n.json > $D/sdpa_$n.log 2>&1; echo "sdpa $n rc=$?"
  grep -o '"sdpa_ms_per_token_step": [0-9.]*' $D/sdpa_$n.json | head -1
}
point 512k1 524288 1
point 128k1 131072 1
point 32k4 32768 4
kvf_tag bench/results/stop30/s32k16.jsonl a_32k16 > $D/rows_32k16.jsonl
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows_32k16.jsonl $D/sdpa_32k16.json > $D/sdpa_32k16.log 2>&1; echo "sdpa 32k16 rc=$?"
grep -o '"sdpa_ms_per_token_step": [0-9.]*' $D/sdpa_32k16.json | head -1
