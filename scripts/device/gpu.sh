#!/usr/bin/env bash
# Copyright kvferry authors. Apache-2.0.
# One call on the GPU machine for the CUDA engine: build, GPU tests (kernels and bank first, the
# CUDA-vs-host runtime comparison in its own process so a device fault there cannot hide kernel
# results), kernel and bank benchmarks, torch SDPA comparison, compute-sanitizer memcheck on a
# subset. Writes at most 8 files under $OUT (default bench/results: the committed results are
# gpu_attention_h100.json (dense decode, sparse rows, transfer probe), transfer_h100.json (the probe
# alone), bank_h100.json and torch_sdpa_h100.json, named by $TAG, default h100) and prints short
# tables last.
#   source .device/on-device.sh && bash scripts/device/gpu.sh [tests|bench|all]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-bench/results}
TAG=${TAG:-h100}
mkdir -p "$OUT"
log=$(mktemp)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 > "$log" 2>&1 ||
  { tail -30 "$log"; exit 1; }
targets="kvferry_tests"
[[ $what != tests ]] && targets="$targets gpu_attention_bench bank_bench"
cmake --build build-gpu -j16 --target $targets > "$log" 2>&1 || { grep -E "error|FAILED" "$log" | head -40; exit 1; }
sum="$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current \
  --format=csv > "$sum" 2>&1
rc=0
if [[ $what != bench ]]; then
  ./build-gpu/tests/kvferry_tests --gtest_filter='Gpu*:TokenBank*:DeviceBank*' --gtest_brief=1 \
    > "$OUT/tests.log" 2>&1 || rc=1
  ./build-gpu/tests/kvferry_tests --gtest_filter='Cuda*' > "$OUT/tests_runtime.log" 2>&1 || rc=1
fi
if [[ $what != tests ]]; then
  { echo "==== kernels"; ./build-gpu/bench/gpu_attention_bench "$OUT/gpu_attention_$TAG.json" 2>&1
    python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); json.dump({"device": d["device"], **{k: v for k, v in d.items() if k.startswith("probe_")}}, open(sys.argv[2], "w"), indent=1)' \
      "$OUT/gpu_attention_$TAG.json" "$OUT/transfer_$TAG.json"
    echo "==== bank"; ./build-gpu/bench/bank_bench "$OUT/bank_$TAG.json" 2>&1
    echo "==== torch"; python3 scripts/device/torch_sdpa.py "$OUT/torch_sdpa_$TAG.json" \
      --ours "$OUT/gpu_attention_$TAG.json" 2>&1; } >> "$sum"
fi
if [[ $what != bench ]] && command -v compute-sanitizer > /dev/null; then
  timeout ${MEMCHECK_TIMEOUT:-120} compute-sanitizer --tool memcheck --error-exitcode 9 \
    ./build-gpu/tests/kvferry_tests --gtest_brief=1 \
    --gtest_filter='*GpuAttend*d128_bf16_g4*:*GpuAttend*d256_f16_g8*:*GpuAttend*d64_f16_g3*:*GpuMerge*:GpuCopy*:*GpuTopK*:*GpuBankAttend*:*DeviceBank*' \
    > "$OUT/memcheck.log" 2>&1 || rc=1
fi
echo "==== tests (kernels, bank)"; tail -12 "$OUT/tests.log" 2>/dev/null
echo "==== tests (runtime cuda vs host)"; grep -E "^\[  (PASSED|FAILED|  OK|SKIPPED)|Failure|status|illegal" \
  "$OUT/tests_runtime.log" 2>/dev/null | head -20
echo "==== memcheck"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" 2>/dev/null | tail -5
cat "$sum"
exit $rc
