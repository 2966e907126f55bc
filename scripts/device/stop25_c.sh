#!/usr/bin/env bash
# Stop 25, call C: where HiP's device step goes, keys unique at every position (--unique-kv; the
# default fill repeats one 4096-token chunk, so HiP chooses among 32 identical copies of a key and
# its rebuilt masks churn the bank): hip_bank / sparcas_bank / quest_bank at 128K b1; hip_bank
# with dense_layers 0 at r_m 8 (the default), 1 (a rebuild every step) and 10^6 (no rebuild after
# the first but where k_off moves): the rebuild's cost and the rest's.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry-e2e
rm -f $D/rows.jsonl
U=--unique-kv
kvf_e2e u_1 -- --modes hip_bank,sparcas_bank,quest_bank --contexts 131072 --batches 1 --steps 16 $U
kvf_e2e u_dl0_1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param dense_layers=0
kvf_e2e u_dl0_rm1_1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param dense_layers=0 --param r_m=1
kvf_e2e u_dl0_rminf_1 -- --modes hip_bank --contexts 131072 --batches 1 --steps 16 $U --param dense_layers=0 --param r_m=1000000
timeout 80 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop25c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tail -7 $D/sdpa.log
