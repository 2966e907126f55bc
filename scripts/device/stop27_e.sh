#!/usr/bin/env bash
# Stop 27, call E (not run: stop 27's device time ran out; the next session's first call): KVpop's
# catch-up scored by a grid over the GPU (KvpopScoreKernel, DecodeStepArgs::kvpop_catchup, on with
# KVFERRY_KVPOP_CATCHUP=1 until this passes): the first token step after a 128K prompt (ms_first_step; 4159 ms
# with one CTA an item in stop27_d), then the CUDA tests that catch up (CudaRuntimeLong/3 from
# 5000 and 4100 stored tokens, CudaEqualsHost kvpop after a 300-token prompt, the graphs).
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
rm -f $D/rows.jsonl
kvf_e2e e_first KVFERRY_KVPOP_CATCHUP=1 -- --modes kvpop_bank --contexts 131072 --batches 1 --steps 2 --unique-kv
grep -o '"ms_first_step":[0-9.]*\|"ms_per_token_step":[0-9.]*' $D/e_first.jsonl | tr '\n' ' '; echo
T=$B/tests/kvferry_tests
KVFERRY_KVPOP_CATCHUP=1 timeout 60 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*/3:*CudaEqualsHost/*kvpop*:*CudaGraph*kvpop*:FaultsKvpop*decode*Cuda*' > $D/t_e.log 2>&1
echo "== t_e"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/t_e.log | head -12
