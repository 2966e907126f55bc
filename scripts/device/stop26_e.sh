#!/usr/bin/env bash
# Stop 26, call E: issue 13's flat check with a fixed budget past it: hip_bank selecting 2622
# tokens (2% of 128K) at 128K and at 512K b1, keys unique, in one call (host store 110 GiB).
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
kvf_e2e flat -- --modes hip_bank --contexts 131072,524288 --batches 1 --steps 16 --unique-kv --budget-tokens 2622 --host-gib 110
