#!/usr/bin/env bash
# Stop 27, call E (not run: stop 27's device time ran out; the next session's first call). The
# code since stop27_d: KVpop's catch-up scored by a grid over the GPU (KvpopScoreKernel,
# DecodeStepArgs::kvpop_catchup, on with KVFERRY_KVPOP_CATCHUP=1 until this passes) and the
# selection kernel's branches that read its scores. (1) The first token step after a 128K prompt
# (ms_first_step; 4159 ms with one CTA an item in stop27_d) with the grid on, and off beside it.
# (2) The whole suite in two shards with the grid on (every kvpop CUDA test then catches up with
# it), memcheck over the kvpop CUDA tests with it on.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
rm -f $D/rows.jsonl
kvf_e2e e_first_grid KVFERRY_KVPOP_CATCHUP=1 -- --modes kvpop_bank --contexts 131072 --batches 1 --steps 4 --unique-kv
kvf_e2e e_first_cta -- --modes kvpop_bank --contexts 131072 --batches 1 --steps 4 --unique-kv
grep -o '"ms_first_step":[0-9.]*\|"ms_per_token_step":[0-9.]*' $D/e_first_grid.jsonl $D/e_first_cta.jsonl | tr '\n' ' '; echo
T=$B/tests/kvferry_tests
export KVFERRY_KVPOP_CATCHUP=1
for i in 0 1; do
  GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 300 $T --gtest_brief=1 > $D/shard$i.log 2>&1 &
done
timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 \
  --gtest_filter='*CudaEqualsHost/*kvpop*:*CudaRuntimeLong*/3:*CudaGraph*kvpop*' > $D/memcheck.log 2>&1 &
wait
for f in shard0 shard1 memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -10
done
