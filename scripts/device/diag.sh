#!/usr/bin/env bash
# On the GPU machine: build, then (1) kvferry-e2e decode rows with a host trace of one step,
# (2) nsys kernel summary of a dense all-resident step, (3) racecheck on the newer kernels.
# Everything lands in $OUT/diag.tgz plus a summary on stdout.
set -u
B=${B:-/tmp/b}; D=/tmp/diag; mkdir -p $D
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 -DKVFERRY_BUILD_EXAMPLES=OFF > $D/cmake.log 2>&1 || { tail -30 $D/cmake.log; exit 1; }
cmake --build $B -j16 --target kvferry_tests kvferry-e2e lfps_select_bench > $D/build.log 2>&1 || { grep -E "error|FAILED" $D/build.log | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
timeout 300 $B/bench/kvferry-e2e --modes ${MODES:-lfps,dense_resident} --contexts ${CTX:-32768,65536} --batches 1 --steps 8 --trace $D/tr --json $D/e2e_rows.jsonl > $D/e2e.log 2>&1; echo "e2e rc=$?"
python3 - $D/e2e_rows.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print(r.get('mode'),r.get('context'),r.get('ms_per_token_step'),r.get('stages_ms_per_step'))
PY
if [ -n "${NSYS:-}" ] && command -v nsys >/dev/null; then
  timeout 120 nsys profile -o $D/dense --force-overwrite true $B/bench/kvferry-e2e --modes dense_resident --contexts 32768 --batches 1 --steps 4 > $D/nsys_run.log 2>&1
  nsys stats -r cuda_gpu_kern_sum $D/dense.nsys-rep > $D/nsys_kern.txt 2>&1; head -30 $D/nsys_kern.txt
fi
if [ -n "${RACE:-}" ]; then
  timeout ${RACE_T:-200} compute-sanitizer --tool racecheck $B/tests/kvferry_tests --gtest_brief=1 --gtest_filter="$RACE" > $D/race.log 2>&1; echo "racecheck rc=$?"
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED" $D/race.log | head
fi
rm -f $D/*.nsys-rep $D/*.sqlite
tar czf $OUT/diag.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
