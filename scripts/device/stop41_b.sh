#!/usr/bin/env bash
# Stop 41, call B: the split's CPU share swept by hand (KVFERRY_SPLIT_SHARE 0.2 / 0.4 / 0.6 / 0.8)
# at the two points where stop41_a's cost-model shares differed most (kvpop 128K x 4, sparcas 128K
# x 1; keys unique, 2%, no bank, route auto), beside the cost model's own share in the same call:
# how far the model's share is from the best one.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
U=--unique-kv
for m in "kvpop 4" "sparcas 1"; do
  set -- $m
  kvf_e2e model_$1_b$2 -- --modes $1 --contexts 131072 --batches $2 --steps 8 $U --route auto
  for s in 0.2 0.4 0.6 0.8; do
    kvf_e2e share${s}_$1_b$2 KVFERRY_SPLIT_SHARE=$s -- --modes $1 --contexts 131072 --batches $2 --steps 8 $U --route auto
  done
done
python3 - $D/rows.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r.get("variant"), "no_graph %.3f" % r.get("ms_per_token_step_no_graph", -1), "rows_cpu", r.get("rows_cpu_per_step"),
          "of", r.get("rows_selected_per_step"), "cpu_gbps %.1f/%.1f" % (r.get("cost_cpu_gbps", 0), r.get("cost_cpu_gbps_measured", 0)), r.get("skipped", ""))
PY
