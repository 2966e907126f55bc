#!/usr/bin/env bash
# Stop 43, call B (right after A, same warm machine and build): the cross-layer prefetch through
# kvferry-e2e at 128K b1 and b4 (keys unique, 2%, device bank, a drifting query so that the bank
# misses): xl+sparcas_bank / xl+quest_bank / xl+kvpop_bank with the prefetch (default) and without
# (KVFERRY_XL_PREFETCH=0), the base sparcas_bank beside them; at b1 also with 150 us of engine GPU
# work after each layer (what the prefetch can hide behind); torch SDPA in the same call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
[ -x $B/bench/kvferry-e2e ] || kvf_build kvferry-e2e
rm -f $D/rows.jsonl
U="--unique-kv --query-drift 0.5 --steps 12 --contexts 131072"
kvf_e2e pf_b1 -- --modes sparcas_bank,xl+sparcas_bank,xl+quest_bank,xl+kvpop_bank --batches 1 $U
kvf_e2e nopf_b1 KVFERRY_XL_PREFETCH=0 -- --modes xl+sparcas_bank,xl+quest_bank,xl+kvpop_bank --batches 1 $U
kvf_e2e pf_b1_eng -- --modes xl+sparcas_bank,xl+kvpop_bank --batches 1 $U --engine-gpu-us 150
kvf_e2e nopf_b1_eng KVFERRY_XL_PREFETCH=0 -- --modes xl+sparcas_bank,xl+kvpop_bank --batches 1 $U --engine-gpu-us 150
kvf_e2e pf_b4 -- --modes xl+sparcas_bank,xl+kvpop_bank --batches 4 $U
kvf_e2e nopf_b4 KVFERRY_XL_PREFETCH=0 -- --modes xl+sparcas_bank,xl+kvpop_bank --batches 4 $U
python3 - $D/rows.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r.get("variant"), r.get("mode"), "b%s" % r.get("batch"), "graph %.3f" % r.get("ms_per_token_step", -1),
          "no_graph %.3f" % r.get("ms_per_token_step_no_graph", -1), "prefetched/step", r.get("decode_prefetched_per_step"),
          "hit", r.get("rows_bank_hit_per_step"), "fetched", r.get("rows_fetched_per_step"), r.get("skipped", ""))
PY
timeout 150 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop43b.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -8 $D/sdpa.log
