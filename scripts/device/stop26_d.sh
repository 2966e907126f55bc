#!/usr/bin/env bash
# Stop 26, call D (right after C, the build kept): e2e with keys unique, the defaults (lag 1,
# dense_bits 4): hip_bank 128K b1 and b4, dense_bits 16 beside (exact dense layers), 32K b1, and
# issue 13's flat check at 512K b1 (host store 110 GiB); sparcas_bank 128K b1 beside; SDPA.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e d4_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e d16_b1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param dense_bits=16
kvf_e2e d4_b4 -- --modes hip_bank --contexts 131072 --batches 4 --steps 16 $U
kvf_e2e d4_32k -- --modes hip_bank --contexts 32768 --batches 1 --steps 16 $U
kvf_e2e d4_512k -- --modes hip_bank --contexts 524288 --batches 1 --steps 16 $U --host-gib 110
python3 -c "
import json, sys
with open(sys.argv[2], 'w') as f:
    for l in open(sys.argv[1]):
        if json.loads(l)['context'] <= 131072: f.write(l)" $D/rows.jsonl $D/rows128.jsonl
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows128.jsonl $D/e2e_stop26d.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -6 $D/sdpa.log
