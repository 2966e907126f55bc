#!/usr/bin/env bash
# Sourced by the stop scripts on the GPU machine: B (build folder), D (results folder), t0, and
# kvf_build TARGET... (Release, sm_90, examples off; the logs in $D, the first errors on failure).
B=${B:-/tmp/b}; D=${D:-/tmp/r}; mkdir -p "$D"
t0=$(date +%s)
kvf_build() {
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 \
    -DKVFERRY_BUILD_EXAMPLES=OFF > "$D/cmake.log" 2>&1 || { tail -30 "$D/cmake.log"; exit 1; }
  cmake --build "$B" -j16 --target "$@" > "$D/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$D/build.log" | head -40; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
}
