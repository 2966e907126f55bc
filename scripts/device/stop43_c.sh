#!/usr/bin/env bash
# Stop 43, call C: where the cross-layer prefetch pays. Call B found it slower in an
# attention-only loop (nothing between the layers' Decodes to hide its reads behind) and faster
# with 150 us of engine GPU work a layer at b1. Here: the engine's GPU work per layer 50 and 300 us
# at b1 (xl+sparcas_bank, xl+quest_bank), 150 us at b4 (xl+sparcas_bank, xl+quest_bank), prefetch
# on and off (KVFERRY_XL_PREFETCH=0), keys unique, 2%, drifting query; torch SDPA in the same call.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
[ -x $B/bench/kvferry-e2e ] || kvf_build kvferry-e2e
rm -f $D/rows.jsonl
U="--unique-kv --query-drift 0.5 --steps 12 --contexts 131072"
for e in 50 300; do
  kvf_e2e pf_b1_e$e -- --modes xl+sparcas_bank,xl+quest_bank --batches 1 $U --engine-gpu-us $e
  kvf_e2e nopf_b1_e$e KVFERRY_XL_PREFETCH=0 -- --modes xl+sparcas_bank,xl+quest_bank --batches 1 $U --engine-gpu-us $e
done
kvf_e2e pf_b4_e150 -- --modes xl+sparcas_bank,xl+quest_bank --batches 4 $U --engine-gpu-us 150
kvf_e2e nopf_b4_e150 KVFERRY_XL_PREFETCH=0 -- --modes xl+sparcas_bank,xl+quest_bank --batches 4 $U --engine-gpu-us 150
python3 - $D/rows.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r.get("variant"), r.get("mode"), "b%s" % r.get("batch"), "eng", r.get("engine_gpu_us"), "graph %.3f" % r.get("ms_per_token_step", -1),
          "no_graph %.3f" % r.get("ms_per_token_step_no_graph", -1), "prefetched/step", r.get("decode_prefetched_per_step"),
          "fetched", r.get("rows_fetched_per_step"), r.get("skipped", ""))
PY
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop43c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -3 $D/sdpa.log
