#!/usr/bin/env bash
# Next session, call B (written at stop 43, not yet run): the scale table's route rows at the
# points stop 41 left out. For a device-selecting policy without a bank (sparcas, kvpop; the split
# applies there only), under the 8 GiB cap, keys unique, 2%, eager steps (a graph holds no split):
# route gpu, route auto (the scheduler's split, its share following the steps) and every miss on
# the CPU (KVFERRY_SPLIT_SHARE=1), at 512K x 1; torch SDPA uncapped in the
# same call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
U="--unique-kv --steps 8 --gpu-gib 8 --host-gib 110"
rm -f $D/rows.jsonl
kvf_route_rows r512k1 sparcas,kvpop --contexts 524288 --batches 1 $U
kvf_rows
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop44b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -4 $D/sdpa.log
