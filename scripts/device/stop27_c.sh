#!/usr/bin/env bash
# Stop 27, call C: kvpop selected on the device, flat past the budget and under a 24 GB card's
# cap. (1) The flat check: a fixed budget of 2622 tokens (2% of 128K) at 128K and 512K, b1, bank
# on. (2) Issue 14's scale points under an 8 GiB cap (a 24 GB card minus 16 GB of bf16 weights;
# the bank takes what the cap leaves): kvpop_bank and quest_bank at 128K x 4 and 32K x 16. Keys
# unique; torch SDPA uncapped in the same call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e c_flat -- --modes kvpop_bank --contexts 131072,524288 --batches 1 --steps 16 $U --budget-tokens 2622 --host-gib 110
cp $D/rows.jsonl $D/rows_flat.jsonl; rm -f $D/rows.jsonl
kvf_e2e c_cap128k4 -- --modes kvpop_bank,quest_bank --contexts 131072 --batches 4 --steps 8 $U --gpu-gib 8 --host-gib 110
kvf_e2e c_cap32k16 -- --modes kvpop_bank,quest_bank --contexts 32768 --batches 16 --steps 8 $U --gpu-gib 8 --host-gib 110
timeout 150 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop27c_cap.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -4 $D/sdpa.log
