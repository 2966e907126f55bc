#!/usr/bin/env bash
# On the GPU machine: build (Release, sm_90), run the GPU tests and the Runtime end to end
# (kvferry-e2e + torch SDPA in the same run). Results under $OUT.
#   SRC: source tree (default .); B: build dir; E2E_ARGS: arguments for kvferry-e2e;
#   TEST_FILTER: gtest filter ('' = all tests, 'none' = skip).
set -u
SRC=${SRC:-.}
B=${B:-/tmp/b}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
t0=$(date +%s)
cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 \
  -DKVFERRY_BUILD_EXAMPLES=${EXAMPLES:-OFF} > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build "$B" -j16 --target kvferry_tests kvferry-e2e ${EXTRA_TARGETS:-} > "$OUT/build.log" 2>&1 \
  || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
if [ "${TEST_FILTER:-}" != none ]; then
  "$B/tests/kvferry_tests" --gtest_brief=1 ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" "$OUT/tests.log" | head -40
fi
if [ -n "${E2E_ARGS:-}" ]; then
  rm -f "$OUT/e2e_rows.jsonl"
  timeout ${E2E_TIMEOUT:-420} "$B/bench/kvferry-e2e" --json "$OUT/e2e_rows.jsonl" $E2E_ARGS > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$?"; tail -3 "$OUT/e2e.log"
  python3 scripts/device/e2e_sdpa.py "$OUT/e2e_rows.jsonl" "$OUT/e2e_h100.json"
  python3 "$SRC/bench/plot.py" --results "$OUT" --only e2e || echo "e2e: no plot (matplotlib?)"
fi
echo "total: $(( $(date +%s) - t0 )) s"
