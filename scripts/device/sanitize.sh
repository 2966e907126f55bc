#!/usr/bin/env bash
# On the GPU machine: compute-sanitizer memcheck, racecheck and synccheck over every GPU test of
# kvferry_tests (the suites that launch kernels: Cuda*, Gpu*, the device bank, the cuBLAS matmul),
# each tool's tests split into shards that run side by side on the one GPU. Summaries under $OUT.
# racecheck over every test costs hours; kernel_cover.sh makes a SAN_LIST that launches every kernel
# shape racecheck can judge (docs/reliability.md, "racecheck by kernel shape").
#   B: a build dir with tests/kvferry_tests (built if missing); SHARDS_{MEM,RACE,SYNC}: shard
#   counts; SAN_TIMEOUT: seconds per shard; SAN_FILTER: the gtest filter of the GPU tests;
#   SAN_PART=k/n: the k-th of n disjoint parts of those tests (one call each); SAN_LIST=file: only
#   the tests it names, one a line; TOOLS: which tools; SAN_COSTS=file ("test seconds" a line, the
#   seconds a test took under the tool before): a queue instead of gtest shards (below); SAN_SKIP=
#   files (':'-separated, a test a line: e.g. the ok.txt and failed.txt of an earlier call): with
#   SAN_COSTS, tests left out of the queue. SAN_KERNELS=substring: the tools check only the kernels
#   whose name holds it (compute-sanitizer's kernel-name filter; the others run unchecked at full
#   speed), for a kernel whose only tests take too long under a tool (docs/reliability.md).
set -u
SRC=${SRC:-.}
B=${B:-/tmp/b}
OUT=${OUT:-/tmp/sanitize}
mkdir -p "$OUT"
if [ ! -x "$B/tests/kvferry_tests" ]; then
  cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 \
    -DKVFERRY_BUILD_EXAMPLES=${KVF_EXAMPLES:-ON} > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  cmake --build "$B" -j16 --target kvferry_tests > "$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
fi
# Under a sanitizer a launch returns only once its kernel ran, so the test that holds the CPU part
# of a split step until Decode returned would wait forever: it drops the hold (and keeps the rest).
export KVFERRY_TEST_NO_HOLD=1
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
FILTER=${SAN_FILTER:-'Cuda*:*Cuda*:Gpu*:*Gpu*:*DeviceBank*:*DeviceMap*:LlamaGpuMatmul*'}
KSEL=()
if [ -n "${SAN_KERNELS:-}" ]; then  # the option's name: --kernel-name (newer) or --filter (older)
  if "$SAN" --help 2>&1 | grep -q -- "--kernel-name"; then KSEL=(--kernel-name "kns=$SAN_KERNELS");
  else KSEL=(--filter "kns=$SAN_KERNELS"); fi
  echo "kernels: ${KSEL[*]}"
fi
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
# SAN_COSTS: the tests (of SAN_FILTER / SAN_PART / SAN_LIST) become batches, longest first (a test
# of 20 s or more alone, shorter ones packed up to 20 s; a test the file does not name counts 1 s),
# and each tool's workers take the next batch from one queue until it is empty or SAN_TIMEOUT from
# the start has passed. A worker loses at most the batch it is in when time runs out, the longest
# run first, so that a call's time goes where it is needed; ok.txt lists every test that passed
# under the tool (what the next call's SAN_LIST leaves out).
if [ -n "${SAN_COSTS:-}" ]; then
  "$B/tests/kvferry_tests" --gtest_list_tests --gtest_filter="$FILTER" |
    awk '/^[^ ]/ {suite=$1; next} /^  / {print suite $1}' > "$OUT/queue_tests.txt"
  rm -rf "$OUT"/claim.* "$OUT"/*.q[0-9]*.log
  if [ -n "${SAN_SKIP:-}" ]; then
    IFS=: read -ra skip_files <<< "$SAN_SKIP"
    cat "${skip_files[@]}" 2> /dev/null | sort -u > "$OUT/skip.txt"
    grep -vxFf "$OUT/skip.txt" "$OUT/queue_tests.txt" > "$OUT/queue_left.txt"
    echo "left out (SAN_SKIP): $(( $(wc -l < "$OUT/queue_tests.txt") - $(wc -l < "$OUT/queue_left.txt") ))"
    mv "$OUT/queue_left.txt" "$OUT/queue_tests.txt"
  fi
  python3 - "$SAN_COSTS" "$OUT/queue_tests.txt" "$OUT" <<'PY'
import sys
costs = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 2:
        costs[f[0]] = float(f[1])
tests = [t.strip() for t in open(sys.argv[2]) if t.strip()]
tests.sort(key=lambda t: -costs.get(t, 1.0))
batches, cur, cur_s = [], [], 0.0
for t in tests:
    c = costs.get(t, 1.0)
    if c >= 20:
        batches.append([t])
        continue
    if cur and cur_s + c > 20:
        batches.append(cur); cur, cur_s = [], 0.0
    cur.append(t); cur_s += c
if cur:
    batches.append(cur)
with open(sys.argv[3] + "/queue.txt", "w") as q:
    for b in batches:
        q.write(":".join(b) + "\n")
print("queue: %d tests in %d batches, %.0f s by the costs" %
      (len(tests), len(batches), sum(costs.get(t, 1.0) for t in tests)))
PY
fi
queue_worker() {  # tool worker extra-args: the next unclaimed batch of queue.txt until none or time is up
  local tool=$1 w=$2 i=0 filter
  shift 2
  while IFS= read -r filter; do
    if mkdir "$OUT/claim.$tool.$i" 2> /dev/null; then
      local left=$(( t0 + TIMEOUT - $(date +%s) ))
      [ "$left" -le 5 ] && break
      timeout "$left" "$SAN" --tool "$tool" "$@" --print-limit 20 "$B/tests/kvferry_tests" \
        --gtest_filter="$filter" > "$OUT/$tool.q$i.log" 2>&1
    fi
    i=$((i + 1))
  done < "$OUT/queue.txt"
}
pids=()
run_tool() {  # tool shards extra-args
  local tool=$1 shards=$2
  shift 2
  if [ -n "${SAN_COSTS:-}" ]; then
    for ((i = 0; i < shards; i++)); do queue_worker "$tool" "$i" "$@" & pids+=($!); done
    return
  fi
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
    memcheck) run_tool memcheck "${SHARDS_MEM:-4}" --leak-check no "${KSEL[@]}" ;;
    racecheck) run_tool racecheck "${SHARDS_RACE:-6}" --racecheck-report hazard "${KSEL[@]}" ;;
    synccheck) run_tool synccheck "${SHARDS_SYNC:-4}" "${KSEL[@]}" ;;
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
  grep -h '^\[       OK \]' "$OUT/$tool".*.log | awk '{print $4}' | sort -u > "$OUT/$tool.ok.txt"
  grep -h '^\[  FAILED  \] [^ ]* (' "$OUT/$tool".*.log | awk '{print $4}' | sort -u > "$OUT/$tool.failed.txt"
  # What each test took under the tool ("test seconds"): the SAN_COSTS of a later call.
  grep -h '^\[       OK \] [^ ]* ([0-9]* ms)' "$OUT/$tool".*.log |
    awk '{gsub(/\(/, "", $5); printf "%s %.1f\n", $4, $5 / 1000}' | sort -u > "$OUT/$tool.times.txt"
  grep -h "SUMMARY" "$OUT/$tool".*.log | sort | uniq -c
  grep -h -E "^\[  FAILED  \]" "$OUT/$tool".*.log | head -8
  grep -h -E "^========= [A-Z]" "$OUT/$tool".*.log | grep -v "SUMMARY\|COMPUTE-SANITIZER" | sort | uniq -c | sort -rn | head -8
done
tar czf "$OUT/sanitize_logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) 2>/dev/null
