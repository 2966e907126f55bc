#!/usr/bin/env bash
# Stop 16 diagnostic: per-CTA timestamps of two consecutive dense all-resident step kernels
# (KVFERRY_STEP_TRACE, printf in StepAttnKernel) at 32K batch 1 and 4 and 128K batch 1.
set -u
B=/tmp/b; D=/tmp/r; mkdir -p $D
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 -DKVFERRY_BUILD_EXAMPLES=OFF > $D/cmake.log 2>&1 || { tail -30 $D/cmake.log; exit 1; }
cmake --build $B -j16 --target kvferry-e2e > $D/build.log 2>&1 || { grep -E "error|FAILED" $D/build.log | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
E=$B/bench/kvferry-e2e
for cb in 32768:1 32768:4 131072:1; do
  c=${cb%:*}; b=${cb#*:}
  KVFERRY_STEP_TRACE=300 timeout 90 $E --modes dense_resident --contexts $c --batches $b --steps 12 --json $D/tr_${c}_${b}.jsonl > $D/tr_${c}_${b}.log 2>&1
  echo "$c $b rc=$? lines $(grep -c STEPTR $D/tr_${c}_${b}.log)"
done
tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"
