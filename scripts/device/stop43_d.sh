#!/usr/bin/env bash
# Stop 43, call D: the runtime's side streams at the greatest priority (KVFERRY_SIDE_PRIORITY=1,
# an experiment) against the default, for the cross-layer prefetch in the attention-only loop
# (where call B found it 0.78-0.88x of no prefetch) and with 150 us of engine work: b1, 128K,
# xl+sparcas_bank / xl+quest_bank / xl+kvpop_bank, prefetch on / off.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
U="--unique-kv --query-drift 0.5 --steps 12 --contexts 131072 --batches 1"
M=xl+sparcas_bank,xl+quest_bank,xl+kvpop_bank
kvf_e2e hp_pf KVFERRY_SIDE_PRIORITY=1 -- --modes $M $U
kvf_e2e hp_nopf KVFERRY_SIDE_PRIORITY=1 KVFERRY_XL_PREFETCH=0 -- --modes $M $U
kvf_e2e pf -- --modes $M $U
kvf_e2e nopf KVFERRY_XL_PREFETCH=0 -- --modes $M $U
kvf_e2e hp_pf_e150 KVFERRY_SIDE_PRIORITY=1 -- --modes xl+sparcas_bank $U --engine-gpu-us 150
python3 - $D/rows.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r.get("variant"), r.get("mode"), "eng", r.get("engine_gpu_us"), "graph %.3f" % r.get("ms_per_token_step", -1),
          "no_graph %.3f" % r.get("ms_per_token_step_no_graph", -1), "prefetched/step", r.get("decode_prefetched_per_step"))
PY
