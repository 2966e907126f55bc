#!/usr/bin/env bash
# Copyright kvferry authors. Apache-2.0.
# On the GPU machine: build kvferry_tests (Release, CUDA) and run them, the GPU suites first (the
# kernels and the device bank, then the CUDA-vs-host runtime comparison in its own process, so a
# device fault there cannot hide the kernel results; the two run side by side, as a loaded GPU
# is where ordering bugs show), then every other test. Logs under $OUT.
#   B: build folder (default /tmp/b); TEST_FILTER: a gtest filter for the last run (default: all
#   tests not run before); TARGETS: more CMake targets to build alongside (e.g. kvferry-e2e);
#   DEADLINE: seconds from the start by which every run is stopped (default none).
#   Sanitizers: scripts/device/sanitize.sh (racecheck over a kernel-shape cover: kernel_cover.sh).
set -u
source scripts/device/build.sh
OUT=${OUT:-/tmp/test}
D=$OUT; mkdir -p "$OUT"
kvf_build kvferry_tests ${TARGETS:-}
T="$B/tests/kvferry_tests"
left() {  # seconds left before DEADLINE (a day without one)
  if [ -n "${DEADLINE:-}" ]; then echo $(( t0 + DEADLINE - $(date +%s) )); else echo 86400; fi
}
rc=0
GPU='Gpu*:*Gpu*:*DeviceBank*:*DeviceMap*:TokenBank*:LlamaGpuMatmul*'
timeout "$(left)" "$T" --gtest_brief=1 --gtest_filter="$GPU" > "$OUT/tests_gpu.log" 2>&1 &
p1=$!
timeout "$(left)" "$T" --gtest_brief=1 --gtest_filter='Cuda*:*Cuda*' > "$OUT/tests_cuda.log" 2>&1 &
p2=$!
wait $p1 || rc=1
wait $p2 || rc=1
timeout "$(left)" "$T" --gtest_brief=1 --gtest_filter="${TEST_FILTER:--$GPU:Cuda*:*Cuda*}" > "$OUT/tests_rest.log" 2>&1 || rc=1
for f in "$OUT"/tests_*.log; do
  echo "== $(basename "$f")"
  grep -E "^\[  (PASSED|FAILED) |^\[==========\]|tests? (ran|skipped)" "$f" | tail -4
done
echo "total: $(( $(date +%s) - t0 )) s, rc=$rc"
exit $rc
