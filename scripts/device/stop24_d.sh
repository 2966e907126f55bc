#!/usr/bin/env bash
# Stop 24, call D: the fold of stop24_c taken out again (no gain: 4.14 vs 3.99 ms at 128K b1 with
# it, 9.47 vs 9.56 at b4); what stays (SparcasScoreQ4Kernel<4> for groups of 4, the weights pass's
# block-reduced merge) is the configuration stop24_c timed as nofold. The multi-CTA and CUDA-vs-host
# tests (fused and per-pass launches).
set -u
source scripts/device/build.sh
trap 'tar czf $OUT/r.tgz -C $D . ; echo "total: $(( $(date +%s) - t0 )) s"' EXIT
kvf_build kvferry_tests
T=$B/tests/kvferry_tests
timeout 40 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*:*CudaEqualsHost*sparcas*:*SelectTopK*:*Mcta*' > $D/t_default.log 2>&1 &
KVFERRY_MCTA_FUSED=0 timeout 40 $T --gtest_brief=1 --gtest_filter='*CudaRuntimeLong*' > $D/t_perpass.log 2>&1 &
wait
for f in t_default t_perpass; do
  echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|FAILED" $D/$f.log | head -8
done
