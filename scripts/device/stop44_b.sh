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
route_rows() {  # route_rows NAME CONTEXT BATCH
  local n=$1 c=$2 b=$3
  kvf_e2e ${n}_gpu -- --modes sparcas,kvpop --contexts $c --batches $b $U --route gpu
  kvf_e2e ${n}_auto -- --modes sparcas,kvpop --contexts $c --batches $b $U --route auto
  kvf_e2e ${n}_cpu KVFERRY_SPLIT_SHARE=1 -- --modes sparcas,kvpop --contexts $c --batches $b $U --route auto
}
route_rows r512k1 524288 1
python3 - $D/rows.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r.get("variant"), r.get("mode"), r.get("context"), "b%s" % r.get("batch"),
          "no_graph %.3f" % r.get("ms_per_token_step_no_graph", -1), "split/step", r.get("decode_split_per_step"),
          "share", r.get("split_share"), r.get("skipped", ""))
PY
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop44b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -4 $D/sdpa.log
