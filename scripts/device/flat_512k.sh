#!/usr/bin/env bash
# Ready for the next GPU call (written in stop 22, not yet run; stop22_e ran out of device time in
# the 512K fill): issue 13's flat-step check, sparcas_bank and quest_bank at 128K and 512K, batch 1
# (512K: 64 GiB of host KV of the machine's 128 GiB), the selection timed alone and the bank's hit
# rate in each row; SDPA at 128K in the same call (512K's 64 GiB of KV would not leave SDPA room).
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
kvf_e2e flat -- --modes sparcas_bank,quest_bank --contexts 131072,524288 --batches 1 --steps 10 --host-gib 110
python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
with open(sys.argv[2], 'w') as f:
    for r in rows:
        if r['context'] <= 131072: f.write(json.dumps(r) + '\n')" $D/rows.jsonl $D/rows128.jsonl
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows128.jsonl $D/e2e_flat.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
