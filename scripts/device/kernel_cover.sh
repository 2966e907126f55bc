#!/usr/bin/env bash
# Copyright kvferry authors. Apache-2.0.
# On the GPU machine: a kernel census of the GPU tests, then the cheapest set of them that
# launches every kernel shape (kernel, template instance, block size, shared memory) the suite
# launches. racecheck over every GPU test costs hours of device time (docs/reliability.md);
# racecheck over this cover checks every kernel shape the suite runs in a fraction of it:
#   bash scripts/device/kernel_cover.sh      # writes $OUT/census/{cover.txt,cover_costs.txt}
#   SAN_LIST=$OUT/census/cover.txt SAN_COSTS=$OUT/census/cover_costs.txt TOOLS=racecheck \
#     bash scripts/device/sanitize.sh
#   python3 scripts/device/kernel_cover.py $OUT/census --ok $OUT/racecheck.ok.txt
# Each test runs in its own process (JOBS side by side) with scripts/device/kernel_log.cpp
# injected through CUPTI. B: build dir with tests/kvferry_tests; SAN_FILTER as in sanitize.sh.
set -u
B=${B:-/tmp/b}
OUT=${OUT:-/tmp/sanitize}
D=$OUT/census
rm -rf "$D" && mkdir -p "$D"
CUDA=${CUDA_HOME:-/usr/local/cuda}
LIBDIR=$CUDA/lib64; [ -d "$LIBDIR" ] || LIBDIR=$CUDA/lib
CUPTI=$(ls "$LIBDIR"/libcupti.so "$CUDA"/extras/CUPTI/lib64/libcupti.so 2> /dev/null | head -1)
g++ -std=c++17 -O2 -shared -fPIC "$(dirname "$0")/kernel_log.cpp" -I"$CUDA/include" \
  -I"$CUDA/extras/CUPTI/include" "$CUPTI" -Wl,-rpath,"$(dirname "$CUPTI")" -o "$D/libkernel_log.so" ||
  exit 1
FILTER=${SAN_FILTER:-'Cuda*:*Cuda*:Gpu*:*Gpu*:*DeviceBank*:*DeviceMap*:LlamaGpuMatmul*'}
"$B/tests/kvferry_tests" --gtest_list_tests --gtest_filter="$FILTER" |
  awk '/^[^ ]/ {suite=$1; next} /^  / {print NR, suite $1}' > "$D/list.txt"
one() {  # index test: run it alone, log its kernel shapes and its seconds
  local t0=$(date +%s%N)
  CUDA_INJECTION64_PATH=$D/libkernel_log.so KVF_KERNEL_LOG=$D/$1.k timeout 600 \
    "$B/tests/kvferry_tests" --gtest_filter="$2" > "$D/$1.log" 2>&1
  local rc=$?
  echo "$rc $(( ($(date +%s%N) - t0) / 1000000 ))" > "$D/$1.rc"  # milliseconds
}
export -f one
export B D
t0=$(date +%s)
xargs -P "${JOBS:-16}" -L 1 bash -c 'one "$0" "$1"' < "$D/list.txt"
while read -r i t; do
  read -r rc ms < "$D/$i.rc"
  [ "$rc" = 0 ] || echo "census: $t exited $rc"
  echo "$i $t $(awk -v ms="$ms" 'BEGIN {printf "%.3f", ms / 1000}')"
done < "$D/list.txt" > "$D/tests.txt"
echo "census: $(wc -l < "$D/list.txt") tests in $(( $(date +%s) - t0 )) s"
python3 "$(dirname "$0")/kernel_cover.py" "$D"
