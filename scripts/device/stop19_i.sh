#!/usr/bin/env bash
# Stop 19, call I: PrHS's wrappers around lfps now run the planned CPU step with the GPU scan.
# Tests: the LFPS device-scan runtimes (the wrappers' included), the PrHS and CUDA runtime suites;
# then the scale table's 128K x 1 point under the 8 GiB cap: lfps, cis+lfps, psaw+lfps, xl+lfps,
# full PCIe streaming and dense CPU attention as the baselines, torch SDPA (uncapped) beside them.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 200 $T --gtest_brief=1 --gtest_filter='LfpsDeviceScan*:LfpsPrime*:Prhs*:*CudaRuntime*:*GpuLfpsScan*' > $D/tests.log 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
E="$B/bench/kvferry-e2e --gpu-gib 8 --steps 3 --json $D/rows.jsonl"
rm -f $D/rows.jsonl
step() { local t=$1; shift; timeout $t $E "$@" >> $D/run.log 2>&1; echo "$* rc=$? at $(( $(date +%s) - t0 )) s"; }
step 240 --contexts 131072 --batches 1 --modes lfps,cis+lfps,psaw+lfps,xl+lfps,full_streaming,dense_cpu
timeout 120 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/scale.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
python3 -c "
import json
for r in json.load(open('$D/scale.json'))['rows']:
    print(r['mode'], r['context'], r['batch'], r.get('skipped') or '', round(r.get('ms_per_token_step',0),2), 'ratio', round(r.get('ratio',0),3), 'gpu', r.get('gpu_bytes'), 'scans', r.get('lfps_scans_device_per_step'), 'short', r.get('lfps_scans_device_short_per_step'), 'syncs', r.get('host_syncs_per_step'), 'reused', r.get('prhs_select_reused_per_step'))" 2>&1 | tail -20
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
