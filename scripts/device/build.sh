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

# kvf_e2e NAME [ENV=VALUE ...] -- [kvferry-e2e arguments]: runs $B/bench/kvferry-e2e (200 s at
# most, KVF_TIMEOUT to change) into $D/NAME.jsonl, prints the rows' headline fields, and appends them to $D/rows.jsonl
# with "variant": NAME (what scripts/device/e2e_sdpa.py and bench/plot.py read).
kvf_e2e() {
  local name=$1; shift
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  env "${envs[@]}" timeout "${KVF_TIMEOUT:-200}" "$B/bench/kvferry-e2e" "$@" --json "$D/$name.jsonl" > "$D/$name.log" 2>&1
  echo "$name rc=$? $(grep -o '"mode":"[a-z_+]*"\|"context":[0-9]*\|"batch":[0-9]*\|"ms_per_token_step":[0-9.]*\|"ms_select_device_per_step":[0-9.e-]*\|"rows_bank_hit_per_step":[0-9.e+]*' "$D/$name.jsonl" | tr '\n' ' ')"
  kvf_tag "$D/$name.jsonl" "$name" >> "$D/rows.jsonl"
}

# kvf_tag ROWS.jsonl NAME: the rows with "variant": NAME, to stdout.
kvf_tag() {
  python3 -c "
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); r['variant'] = sys.argv[2]; print(json.dumps(r))" "$1" "$2"
}
