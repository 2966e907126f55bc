#!/usr/bin/env bash
# Everything that needs the GPU machine, in one call: full build with CUDA, every test, the CUDA
# engine script (GPU tests, memcheck, kernel/bank/transfer benchmarks, torch SDPA), the CPU
# engine benchmarks and the runtime end to end. Results under $OUT, tarred.
# Stage a: build, tests, CUDA engine; stage b: runtime end to end and LFPS (rebuilds only if cold).
set -u
stage=${1:-ab}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/r"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 > "$OUT/r/cmake.log" 2>&1
cmake --build build-gpu -j16 > "$OUT/r/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/r/build.log" | head -30; }
if [[ $stage == *a* ]]; then
echo "== all tests (one process)"
timeout 240 ./build-gpu/tests/kvferry_tests --gtest_brief=1 > "$OUT/r/all_tests.log" 2>&1
grep -E "^\[  (PASSED|FAILED) |tests ran" "$OUT/r/all_tests.log" | head -20
grep -E "^\[  FAILED  \]" "$OUT/r/all_tests.log" | head -20
echo "== cuda engine"
OUT=$OUT/r bash scripts/device/gpu.sh all 2>&1 | tail -60
fi
if [[ $stage == *b* ]]; then
echo "== runtime tests (CUDA vs host, host runtime)"
./build-gpu/tests/kvferry_tests --gtest_brief=1 --gtest_filter='Cuda*:*FullBudget*:Selection*:MultiSequence*:BadInput*:TokenBankRuntime*' 2>&1 | grep -E "^\[  (PASSED|FAILED)" | head
echo "== runtime end to end"
BUILD=build-gpu OUT=$OUT/r bash scripts/device/runtime.sh 2>&1 | tail -20
echo "== lfps vs exact top-k (one core)"
timeout 150 ./build-gpu/bench/lfps_bench "$OUT/r/lfps.json" 2> "$OUT/r/lfps.log"; cat "$OUT/r/lfps.log"
fi
cd "$OUT" && tar czf results.tgz r && rm -rf r
