#!/usr/bin/env bash
# Stop 41, call C: the split's share balanced by the steps (Stats::split_share; the device's part
# done first moves it down, else up) at the two points of stop41_b's sweep (kvpop 128K x 4,
# sparcas 128K x 1; keys unique, 2%, no bank, route auto).
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
kvf_e2e bal_sparcas_b1 -- --modes sparcas --contexts 131072 --batches 1 --steps 8 --unique-kv --route auto
kvf_e2e bal_kvpop_b4 -- --modes kvpop --contexts 131072 --batches 4 --steps 8 --unique-kv --route auto
python3 - $D/rows.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r.get("variant"), "no_graph %.3f" % r.get("ms_per_token_step_no_graph", -1), "share %.3f" % r.get("split_share", -1),
          "rows_cpu", r.get("rows_cpu_per_step"), "of", r.get("rows_selected_per_step"),
          "cpu_gbps %.1f" % r.get("cost_cpu_gbps", 0), r.get("skipped", ""))
PY
