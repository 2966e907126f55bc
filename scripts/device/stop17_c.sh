#!/usr/bin/env bash
# Stop 17, call C: build; the decode rows of issue 10's table with the PDL step on the final code
# (streaming with nothing fetched and with 768 rows a head over PCIe, oracle / quest / sparcas with
# and without the device bank, full streaming), lfps@2% auto at 32K and 64K twice with a host
# timeline of one step (--trace); torch SDPA beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry-e2e
E=$B/bench/kvferry-e2e
rm -f $D/rows.jsonl
for rep in 0 1; do
  timeout 100 $E --modes lfps --contexts 32768,65536 --batches 1 --steps 10 --trace $D/tr$rep --json $D/rows.jsonl > $D/lfps$rep.log 2>&1; echo "lfps $rep rc=$?"
done
echo "lfps: $(( $(date +%s) - t0 )) s"
timeout 120 $E --modes streaming_resident,streaming --contexts 32768,131072 --batches 1,4 --steps 10 --json $D/rows.jsonl > $D/str.log 2>&1; echo "streaming rc=$?"
timeout 150 $E --modes oracle,quest,sparcas,oracle_bank,quest_bank,sparcas_bank --contexts 32768,131072 --batches 1 --steps 10 --json $D/rows.jsonl > $D/sel.log 2>&1; echo "selection rc=$?"
timeout 40 $E --modes full_streaming --contexts 32768 --batches 1 --steps 5 --json $D/rows.jsonl > $D/full.log 2>&1; echo "full rc=$?"
echo "decode: $(( $(date +%s) - t0 )) s"
timeout 150 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_c.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
python3 -c "
import json
for r in json.load(open('$D/e2e_c.json'))['rows']:
    print(r['mode'], r['context'], r['batch'], round(r['ms_per_token_step'],3), round(r['ratio'],3), 'syncs', r.get('host_syncs_per_step'))"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
