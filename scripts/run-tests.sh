#!/usr/bin/env bash
# The README's test command: installs what is missing, fetches the test data (the real model and
# text; the real-model tests skip with a message if that fails), builds and runs every test.
# Works with or without a GPU (GPU tests skip cleanly without one).
#
# After the normal tests come the reliability stages (docs/reliability.md), each of which a
# developer can skip:
#   KVFERRY_SANITIZE=0  no ASan+UBSan build: the library and kvferry_tests built with gcc
#                       -fsanitize=address,undefined (build dir $KVFERRY_ASAN_BUILD_DIR, default
#                       <build>-asan) and run on the CPU subset: host backend, runtime, policies,
#                       CPU kernels, the file readers and the CLI ($KVFERRY_ASAN_FILTER)
#   KVFERRY_FUZZ=0      no fuzzing: the libFuzzer targets of tests/fuzz (clang, <build>-fuzz) replay
#                       their corpus, then fuzz KVFERRY_FUZZ_SECONDS (default 20) seconds each
#   KVFERRY_PYTHON=0    no Python stage: a venv (<build>-pyenv) with pinned torch (CPU use) and
#                       transformers from PyPI, `pip install .` of the kvferry package (its own
#                       CMake build, host-only without nvcc), then pytest python/tests
#   KVFERRY_TSAN=0      no ThreadSanitizer stage: oneTBB built from Debian's source package with
#                       -fsanitize=thread (scripts/build-tsan-tbb.sh, cached in <tsan build>/onetbb),
#                       then the library and kvferry_tsan_tests (the worker pool and its lock-free
#                       queues, the runtime's host decode paths, runtimes on several
#                       threads) built with gcc -fsanitize=thread against it (build dir
#                       $KVFERRY_TSAN_BUILD_DIR, default <build>-tsan) and run in shards; any report
#                       fails the stage. Suppressions: tests/tsan.supp (docs/reliability.md)
# KVFERRY_SANITIZE=0 also turns fuzzing off unless KVFERRY_FUZZ=1 (and leaves TSan on).
# KVFERRY_MAIN=0 skips the normal build and tests (to time or rerun the later stages alone).
#
# Disk: the stages together need about 20 GB (the Python venv alone about 5.6 GB at rest and 8.6 GB
# while pip unpacks torch and its CUDA wheels). KVFERRY_CLEAN_STAGES=1 (the default when CI=true)
# removes each stage's build folder once the stage has passed, so the peak is the largest stage,
# not the sum; pip never keeps its wheel cache here. The Python stage is skipped, saying so, when
# the disk has less than KVFERRY_PYTHON_MIN_FREE_GB (default 9) free after that cleanup: a
# machine too small for torch is not a failure of kvferry (a developer can set the threshold to 0).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1
bash scripts/install-deps.sh
python3 scripts/check_tree.py  # names after development steps, docs tables vs bench/results (docs/benchmarks.md)
python3 scripts/check_layers.py  # includes point down the layer order, no folder cycles (scripts/check_layers.py)
if [ -f scripts/fetch-data.sh ]; then
  bash scripts/fetch-data.sh || echo "run-tests: data fetch failed; real-model tests will skip" >&2
fi
build=${KVFERRY_BUILD_DIR:-build}
jobs=$(nproc)
t_start=$SECONDS
stage_times=()
stage_done() { stage_times+=("$1 $(( SECONDS - $2 ))s"); echo "run-tests: $1 took $(( SECONDS - $2 )) s ($(free_gb) GB free)" >&2; }
free_gb() { df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}'; }
clean_stages=${KVFERRY_CLEAN_STAGES:-$([ "${CI:-}" = true ] && echo 1 || echo 0)}
# Removes a stage's build folder after it passed (KVFERRY_CLEAN_STAGES=1).
clean_stage() { if [ "$clean_stages" = 1 ]; then rm -rf "$@"; fi; }
echo "run-tests: $(free_gb) GB free on $(df -Pk . | awk 'NR == 2 {print $6}')" >&2

if [ "${KVFERRY_MAIN:-1}" != 0 ]; then
  t0=$SECONDS
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${KVFERRY_CMAKE_ARGS:-}
  cmake --build "$build" -j"$jobs"
  # Every result line and every failure's output in full; skipped tests (the GPU suites on a
  # machine without a GPU: over a thousand) summed up in one line by suite instead of one line
  # each plus ctest's list of them. The whole output stays in $build/ctest.log.
  ctest --test-dir "$build" --output-on-failure -j"$jobs" --timeout 900 2>&1 | tee "$build/ctest.log" |
    awk '/^ *Start +[0-9]+: / { next }
         /\*\*\*Skipped/ { next }
         /^The following tests did not run:/ { listing = 1; next }
         listing && /^\t.*\(Skipped\)$/ {
           name = $0; sub(/^\t *[0-9]+ - /, "", name); sub(/ \(Skipped\)$/, "", name)
           suite = name; sub(/\..*$/, "", suite); sub(/^.*\//, "", suite)
           if (!(suite in count)) order[++suites] = suite
           count[suite]++; skipped++; next }
         { listing = 0; print; fflush() }
         END {
           if (!skipped) exit
           line = ""
           for (k = 1; k <= suites && k <= 6; k++) {  # the largest suites first
             best = ""; for (i = 1; i <= suites; i++) if (!(order[i] in done) && (best == "" || count[order[i]] > count[best])) best = order[i]
             done[best] = 1; line = line (k > 1 ? ", " : "") best " " count[best]
           }
           if (suites > 6) line = line ", " suites - 6 " more suites"
           printf "run-tests: %d tests skipped (%s; the list: '"$build"'/ctest.log)\n", skipped, line
         }'
  stage_done "build+tests" "$t0"
  clean_stage "$build"
fi

# ---- Python ------------------------------------------------------------------------------------
py_min_free=${KVFERRY_PYTHON_MIN_FREE_GB:-9}
if [ "${KVFERRY_PYTHON:-1}" != 0 ] && [ "$(free_gb)" -lt "$py_min_free" ]; then
  echo "run-tests: Python stage SKIPPED: $(free_gb) GB free, torch's venv needs about $py_min_free GB" \
       "(KVFERRY_PYTHON_MIN_FREE_GB)" >&2
  stage_times+=("python skipped(disk)")
elif [ "${KVFERRY_PYTHON:-1}" != 0 ]; then
  t0=$SECONDS
  pyenv=$(realpath -m "${KVFERRY_PYENV:-$build-pyenv}")
  [ -x "$pyenv/bin/python" ] || python3 -m venv "$pyenv"
  # pip's own lines (no -q): the downloads of torch and its wheels and the package's build take
  # minutes each, and each step says so.
  echo "run-tests: python: installing torch, transformers and the test tools into $pyenv" >&2
  "$pyenv/bin/pip" install --disable-pip-version-check \
    "torch==2.15.0" "transformers==5.23.0" "accelerate" "numpy>=1.22" "pytest>=7" "gguf>=0.10" "safetensors"
  echo "run-tests: python: building and installing the kvferry package (pip install .)" >&2
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$pyenv/bin/pip" install --disable-pip-version-check .
  echo "run-tests: python: pytest python/tests" >&2
  (cd python/tests && "$pyenv/bin/python" -m pytest -q -p no:cacheprovider .)
  stage_done "python" "$t0"
  clean_stage "$pyenv" build-py
fi

sanitize=${KVFERRY_SANITIZE:-1}
tsan=${KVFERRY_TSAN:-1}
fuzz=${KVFERRY_FUZZ:-$sanitize}

# Runs \$1 (a gtest binary) split into $jobs shards in parallel; fails if any shard fails.
run_sharded() {
  local bin=$1 filter=$2 log_prefix=$3 pids=() rc=0
  for ((i = 0; i < jobs; i++)); do
    GTEST_TOTAL_SHARDS=$jobs GTEST_SHARD_INDEX=$i \
      "$bin" --gtest_filter="$filter" --gtest_brief=1 >"$log_prefix.$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      echo "run-tests: shard $i of $bin failed:" >&2
      tail -n 60 "$log_prefix.$i.log" >&2
      rc=1
    fi
  done
  return $rc
}

# ---- ASan + UBSan ------------------------------------------------------------------------------
if [ "$sanitize" != 0 ]; then
  t0=$SECONDS
  asan_build=${KVFERRY_ASAN_BUILD_DIR:-$build-asan}
  san_flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  cmake -S . -B "$asan_build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_CXX_FLAGS="$san_flags" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DKVFERRY_WITH_CUDA=OFF \
    -DKVFERRY_BUILD_BENCH=OFF -DKVFERRY_BUILD_EXAMPLES=ON >/dev/null
  cmake --build "$asan_build" -j"$jobs" --target kvferry_tests kvferry-llama
  # The CPU subset: everything but the GPU suites (which skip without a GPU anyway), the
  # SmolLM2 logit checks (minutes of f32 matmuls under ASan; the readers they use are fuzzed) and
  # the long-context FullBudget instances.
  asan_filter=${KVFERRY_ASAN_FILTER:-"*-Gpu*:Cuda*:*GpuMatmul*:LlamaSmolLm2.*Logits*:LlamaSmolLm2.Sparse*:Long/FullBudget.*:LlamaGguf.FuzzRealFile"}
  # libtbb (not instrumented) can lose the 40-byte proxy of a task_scheduler_observer that is
  # removed while a worker walks the observer list (kvferry calls observe(false) in the
  # destructor); that one TBB-internal allocation is the only leak suppressed.
  lsan_supp="$(cd "$asan_build" && pwd)/lsan.supp"
  printf 'leak:tbb::detail::r1::observe\n' >"$lsan_supp"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1 \
  LSAN_OPTIONS=suppressions=$lsan_supp \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    run_sharded "$asan_build/tests/kvferry_tests" "$asan_filter" "$asan_build/asan"
  stage_done "asan+ubsan" "$t0"
  clean_stage "$asan_build"
fi

# ---- ThreadSanitizer ---------------------------------------------------------------------------
if [ "$tsan" != 0 ]; then
  t0=$SECONDS
  tsan_build=$(realpath -m "${KVFERRY_TSAN_BUILD_DIR:-$build-tsan}")
  bash scripts/build-tsan-tbb.sh "$tsan_build/onetbb"
  # (policies/lfps/lfps.cpp, whose target_clones resolvers run before the TSan runtime is up, is built
  # without TSan's function entry/exit hooks: CMakeLists.txt.)
  cmake -S . -B "$tsan_build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_CXX_FLAGS="-fsanitize=thread" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" -DKVFERRY_WITH_CUDA=OFF \
    -DKVFERRY_BUILD_BENCH=OFF -DKVFERRY_BUILD_EXAMPLES=OFF \
    -DTBB_DIR="$tsan_build/onetbb/prefix/lib/cmake/TBB" >/dev/null
  cmake --build "$tsan_build" -j"$jobs" --target kvferry_tsan_tests
  # The binary must load the instrumented libtbb, not the system's (same soname).
  tbb_loaded=$(ldd "$tsan_build/tests/kvferry_tsan_tests" | awk '/libtbb\.so/ {print $3}')
  case "$tbb_loaded" in
    "$tsan_build/onetbb/prefix/"*) ;;
    *) echo "run-tests: kvferry_tsan_tests loads libtbb from '$tbb_loaded', not the TSan build" >&2
       exit 1 ;;
  esac
  # Everything in the binary but most of the shape sweeps (numerics, not threading: the same
  # parallel paths run for every shape; the d64, n97 instances stay) and the 4099-token FullBudget
  # instances: 79 tests, 0 reports allowed.
  tsan_filter=${KVFERRY_TSAN_FILTER:-"*-Long/*:Shapes/*_n1*:Shapes/*_d128_*"}
  if ! TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
      run_sharded "$tsan_build/tests/kvferry_tsan_tests" "$tsan_filter" "$tsan_build/tsan"; then
    # The report's head (which accesses, where) is above the tail shown: print each shard's.
    for f in "$tsan_build"/tsan.*.log; do
      sed -n '/WARNING: ThreadSanitizer/,/^  Previous/p' "$f" | head -n 40 | sed "s|^|$(basename "$f"): |" >&2
    done
    exit 1
  fi
  stage_done "tsan" "$t0"
  clean_stage "$tsan_build"
fi

# ---- libFuzzer ---------------------------------------------------------------------------------
if [ "$fuzz" != 0 ]; then
  t0=$SECONDS
  fuzz_build=${KVFERRY_FUZZ_BUILD_DIR:-$build-fuzz}
  secs=${KVFERRY_FUZZ_SECONDS:-20}
  CC=clang CXX=clang++ cmake -S . -B "$fuzz_build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DKVFERRY_WITH_CUDA=OFF -DKVFERRY_BUILD_FUZZ=ON -DKVFERRY_BUILD_TESTS=OFF \
    -DKVFERRY_BUILD_BENCH=OFF -DKVFERRY_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$fuzz_build" -j"$jobs" --target kvferry_fuzz
  ctest --test-dir "$fuzz_build/tests/fuzz" --output-on-failure -j"$jobs"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  targets=(gguf llama2c_model llama2c_tokenizer bpe_tokenizer safetensors cli)
  # Two targets at a time (one per core on the CI machine), new inputs into a scratch folder.
  fuzz_one() {
    local t=$1 dict=""
    [ -f "tests/fuzz/$t.dict" ] && dict="-dict=tests/fuzz/$t.dict"
    mkdir -p "$work/$t"
    "$fuzz_build/tests/fuzz/fuzz_$t" $dict -max_total_time="$secs" -rss_limit_mb=4096 -timeout=30 \
      -print_final_stats=1 -artifact_prefix="$work/$t-" "$work/$t" "tests/fuzz/corpus/$t" \
      >"$work/$t.log" 2>&1
  }
  rc=0
  for ((i = 0; i < ${#targets[@]}; i += jobs)); do
    pids=()
    for ((j = i; j < i + jobs && j < ${#targets[@]}; j++)); do
      fuzz_one "${targets[$j]}" &
      pids+=("$!:${targets[$j]}")
    done
    for p in "${pids[@]}"; do
      if ! wait "${p%%:*}"; then
        echo "run-tests: fuzz_${p#*:} found a crash:" >&2
        tail -n 60 "$work/${p#*:}.log" >&2
        ls "$work"/"${p#*:}"-* >&2 2>/dev/null || true
        rc=1
      fi
      grep -h "stat::number_of_executed_units" "$work/${p#*:}.log" |
        sed "s/^/run-tests: fuzz_${p#*:} /" >&2 || true
    done
  done
  [ $rc = 0 ] || exit 1
  stage_done "fuzz" "$t0"
  clean_stage "$fuzz_build"
fi
echo "run-tests: all passed in $(( SECONDS - t_start )) s (${stage_times[*]})" >&2
