#!/usr/bin/env bash
# Stop 22, call E (the last minutes of device time; no build: .device/kvferry-e2e was built from
# this commit on the workstation, sm_90, and carried): (1) full PCIe streaming and quest_bank at 128K
# b1 in one run (issue 14's 100x); (2) the flat-step check: sparcas_bank at 128K and 512K, batch 1
# (512K: 64 GiB of host KV). Rows straight into $OUT as they finish.
set -u
E=.device/kvferry-e2e
t0=$(date +%s)
timeout 60 $E --modes full_streaming --contexts 131072 --batches 1 --steps 2 --json $OUT/full_streaming.jsonl > $OUT/full_streaming.log 2>&1; echo "full_streaming rc=$? $(( $(date +%s) - t0 )) s"
timeout 40 $E --modes quest_bank --contexts 131072 --batches 1 --steps 10 --json $OUT/quest.jsonl > $OUT/quest.log 2>&1; echo "quest rc=$? $(( $(date +%s) - t0 )) s"
timeout 150 $E --modes sparcas_bank --contexts 131072,524288 --batches 1 --steps 10 --host-gib 110 --json $OUT/flat.jsonl > $OUT/flat.log 2>&1; echo "flat rc=$? $(( $(date +%s) - t0 )) s"
grep -ho '"mode":"[a-z_]*"\|"context":[0-9]*\|"ms_per_token_step":[0-9.]*\|"ms_select_device_per_step":[0-9.e-]*' $OUT/*.jsonl | tr '\n' ' '
