#!/usr/bin/env bash
# Stop 27, call D: the CUDA instances of the new fault tests (FaultsKvpop: kvpop selected on the
# device, a failed decode or prefill changes nothing) with the kvpop tests again, and the first
# token step after a 128K prompt (kvferry-e2e's ms_first_step: KVpop catches up with every token
# that left the window) for kvpop_bank next to sparcas_bank.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 150 $T --gtest_brief=1 --gtest_filter='FaultsKvpop*:*KvpopDevice*:*DeviceSelected*kvpop*:*CudaEqualsHost/*kvpop*' > $D/t_d.log 2>&1
echo "== t_d"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/t_d.log | head -12
rm -f $D/rows.jsonl
kvf_e2e d_first -- --modes kvpop_bank,sparcas_bank --contexts 131072 --batches 1 --steps 4 --unique-kv
grep -o '"mode":"[a-z_]*"\|"ms_first_step":[0-9.]*\|"ms_per_token_step":[0-9.]*' $D/d_first.jsonl | tr '\n' ' '; echo
