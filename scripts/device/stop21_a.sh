#!/usr/bin/env bash
# Stop 21, call A: the multi-CTA top-k's five passes fused into one cooperative launch (grid
# barriers, each CTA's chunk of weights in shared memory). The device-selection and runtime tests
# (both multi-CTA paths against the host reference; CUDA graphs capture the cooperative launch);
# select_topk_bench (one CTA / a launch a pass / fused); then at 128K (2%, 32 layers) sparcas_bank
# and quest_bank with the fused kernel and without (KVFERRY_MCTA_FUSED=0), and quest_bank with the
# multi-CTA path from 2048 / 4096 pages (KVFERRY_MCTA_MIN_PAGES), interleaved; SDPA.
set -u
source scripts/device/build.sh
kvf_build kvferry_tests kvferry-e2e select_topk_bench
T=$B/tests/kvferry_tests
E=$B/bench/kvferry-e2e
F='*SelectTopK*:*SelectMcta*:*CudaRuntimeLong*:*CudaRuntimeTest*:*CudaGraph*:*CudaStepBank*:*GpuTopK*:*Sparcas*:*Quest*'
timeout 300 $T --gtest_brief=1 --gtest_filter="$F" > $D/tests.log 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/tests.log | head -12
timeout 60 $B/bench/select_topk_bench $D/select_topk.json > $D/select_topk.log 2>&1; echo "topk bench rc=$?"
head -30 $D/select_topk.log | grep -v "^{"
rm -f $D/rows.jsonl
run() {  # name, modes, batches, env
  local name=$1 modes=$2 bat=$3; shift 3
  env "$@" timeout 150 $E --modes $modes --contexts 131072 --batches $bat --steps 10 --json $D/$name.jsonl > $D/$name.log 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_]*"\|"batch":[0-9]*\|"ms_per_token_step":[0-9.]*' $D/$name.jsonl | tr '\n' ' ')"
  python3 -c "
import json
for l in open('$D/$name.jsonl'):
    r=json.loads(l); r['variant']='$name'; print(json.dumps(r))" >> $D/rows.jsonl
}
run fused_1 sparcas_bank,quest_bank 1,4 KVFERRY_X=1
run perpass_1 sparcas_bank,quest_bank 1,4 KVFERRY_MCTA_FUSED=0
run quest2k_1 quest_bank 1,4 KVFERRY_MCTA_MIN_PAGES=2048
run quest4k_1 quest_bank 1 KVFERRY_MCTA_MIN_PAGES=4096
run fused_2 sparcas_bank,quest_bank 1 KVFERRY_X=1
run perpass_2 sparcas_bank,quest_bank 1 KVFERRY_MCTA_FUSED=0
run quest2k_2 quest_bank 1 KVFERRY_MCTA_MIN_PAGES=2048
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_a.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
