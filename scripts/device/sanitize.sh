#!/usr/bin/env bash
# On the GPU machine: compute-sanitizer memcheck, racecheck and synccheck over every GPU test of
# kvferry_tests (the suites that launch kernels: Cuda*, Gpu*, the device bank, the cuBLAS matmul),
# each tool's tests split into shards that run side by side on the one GPU. Summaries under $OUT.
#   B: a build dir with tests/kvferry_tests (built if missing); SHARDS_{MEM,RACE,SYNC}: shard
#   counts; SAN_TIMEOUT: seconds per shard; SAN_FILTER: the gtest filter of the GPU tests;
#   SAN_PART=k/n: the k-th of n disjoint parts of those tests (one call each); SAN_LIST=file: only
#   the tests it names, one a line; TOOLS: which tools.
set -u
SRC=${SRC:-.}
B=${B:-/tmp/b}
OUT=${OUT:-/tmp/sanitize}
mkdir -p "$OUT"
if [ ! -x "$B/tests/kvferry_tests" ]; then
  cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 \
    -DKVFERRY_BUILD_EXAMPLES=OFF > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  cmake --build "$B" -j16 --target kvferry_tests > "$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
fi
# Under a sanitizer a launch returns only once its kernel ran, so the test that holds the CPU part
# of a split step until Decode returned would wait forever: it drops the hold (and keeps the rest).
export KVFERRY_TEST_NO_HOLD=1
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
FILTER=${SAN_FILTER:-'Cuda*:*Cuda*:Gpu*:*Gpu*:*DeviceBank*:*DeviceMap*:LlamaGpuMatmul*'}
TIMEOUT=${SAN_TIMEOUT:-500}
"$B/tests/kvferry_tests" --gtest_list_tests --gtest_filter="$FILTER" | grep -c '^  ' > "$OUT/gpu_tests.count"
echo "GPU tests: $(cat "$OUT/gpu_tests.count")"
# SAN_PART=k/n: only the tests whose index in the list is k mod n (a complete pass in n calls on
# one commit, each call its own part; the parts are disjoint and together every GPU test).
if [ -n "${SAN_PART:-}" ]; then
  k=${SAN_PART%/*}; n=${SAN_PART#*/}
  FILTER=$("$B/tests/kvferry_tests" --gtest_list_tests --gtest_filter="$FILTER" |
    awk -v k="$k" -v n="$n" '/^[^ ]/ {suite=$1; next} /^  / {if (i++ % n == k) {printf "%s%s%s", sep, suite, $1; sep=":"}}')
  echo "part $SAN_PART: $(echo "$FILTER" | tr ':' '\n' | grep -c .) tests"
fi
# SAN_LIST=file: only the tests named in it, one per line (e.g. those a timed-out pass left).
if [ -n "${SAN_LIST:-}" ]; then
  FILTER=$(grep -v '^ *$' "$SAN_LIST" | paste -sd:)
  echo "list $SAN_LIST: $(grep -vc '^ *$' "$SAN_LIST") tests"
fi
pids=()
run_tool() {  # tool shards extra-args
  local tool=$1 shards=$2
  shift 2
  for ((i = 0; i < shards; i++)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "$TIMEOUT" "$SAN" --tool "$tool" "$@" \
      --print-limit 20 "$B/tests/kvferry_tests" --gtest_filter="$FILTER" \
      > "$OUT/$tool.$i.log" 2>&1 &
    pids+=($!)
  done
}
t0=$(date +%s)
TOOLS=${TOOLS:-memcheck racecheck synccheck}
for tool in $TOOLS; do
  case $tool in
    # The one API error memcheck reports is GpuDevice's deliberate over-sized cudaMalloc.
    memcheck) run_tool memcheck "${SHARDS_MEM:-4}" --leak-check no ;;
    racecheck) run_tool racecheck "${SHARDS_RACE:-6}" --racecheck-report hazard ;;
    synccheck) run_tool synccheck "${SHARDS_SYNC:-4}" ;;
  esac
done
for p in "${pids[@]}"; do wait "$p"; done
echo "sanitizers: $(( $(date +%s) - t0 )) s"
for tool in $TOOLS; do
  done_shards=0; total=0; ok=0
  for f in "$OUT/$tool".*.log; do
    total=$((total + 1))
    if grep -q "SUMMARY" "$f"; then done_shards=$((done_shards + 1)); fi
    ok=$((ok + $(grep -c '^\[       OK \]' "$f")))
  done
  echo "$tool: $done_shards/$total shards finished, $ok tests passed under it"
  grep -h "SUMMARY" "$OUT/$tool".*.log | sort | uniq -c
  grep -h -E "^\[  FAILED  \]" "$OUT/$tool".*.log | head -8
  grep -h -E "^========= [A-Z]" "$OUT/$tool".*.log | grep -v "SUMMARY\|COMPUTE-SANITIZER" | sort | uniq -c | sort -rn | head -8
done
tar czf "$OUT/sanitize_logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) 2>/dev/null
