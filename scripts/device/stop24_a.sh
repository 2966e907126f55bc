#!/usr/bin/env bash
# Stop 24, call A: SparCas's 4-bit scoring in integers (SparcasScoreQ4Kernel: an int8 query,
# __dp4a over the rows' nibbles; the host twin's SparcasQ4Dot the same integer sum):
#  - the CUDA-vs-host tests of sparcas (lists compared exactly, default 4-bit and _bits16 cases),
#    the SparCas unit tests and the long-runtime tests; memcheck over the CUDA-vs-host sparcas cases;
#  - e2e vs SDPA in the same call: sparcas_bank 4-bit (the default) and bits=16 at 128K b1 and b4;
#  - issue 13's flat check: sparcas_bank at 512K (host store 110 GiB) against its 128K row.
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests kvferry-e2e
T=$B/tests/kvferry_tests
timeout 200 $T --gtest_brief=1 --gtest_filter='*Sparcas*:*CudaEqualsHost*sparcas*:*CudaRuntimeLong*:*CudaStepBank*' > $D/tests.log 2>&1 &
timeout 200 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_brief=1 \
  --gtest_filter='*CudaEqualsHost*sparcas*' > $D/memcheck.log 2>&1 &
wait
for f in tests memcheck; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED|ERROR SUMMARY" $D/$f.log | head -12
done
echo "tests: $(( $(date +%s) - t0 )) s"
rm -f $D/rows.jsonl
kvf_e2e q4_1 -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 10
kvf_e2e b16_1 -- --modes sparcas_bank --contexts 131072 --batches 1 --steps 10 --param bits=16
kvf_e2e q4_4 -- --modes sparcas_bank --contexts 131072 --batches 4 --steps 10
kvf_e2e b16_4 -- --modes sparcas_bank --contexts 131072 --batches 4 --steps 10 --param bits=16
timeout 100 python3 scripts/device/e2e_sdpa.py $D/rows.jsonl $D/e2e_stop24a.json > $D/sdpa.log 2>&1; echo "sdpa rc=$?"
cat $D/sdpa.log | tail -6
echo "e2e: $(( $(date +%s) - t0 )) s"
kvf_e2e flat512 -- --modes sparcas_bank --contexts 524288 --batches 1 --steps 10 --host-gib 110
