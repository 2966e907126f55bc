#!/usr/bin/env bash
# Sourced by the device scripts (test.sh) on the GPU machine: B (build folder), D (results folder), t0, and
# kvf_build TARGET... (Release, sm_90, examples on unless KVF_EXAMPLES=OFF; the logs in $D, the first errors on failure).
B=${B:-/tmp/b}; D=${D:-/tmp/r}; mkdir -p "$D"
t0=$(date +%s)
kvf_build() {
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 \
    -DKVFERRY_BUILD_EXAMPLES=${KVF_EXAMPLES:-ON} > "$D/cmake.log" 2>&1 || { tail -30 "$D/cmake.log"; exit 1; }
  cmake --build "$B" -j16 --target "$@" > "$D/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$D/build.log" | head -40; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
}

# kvf_e2e NAME [ENV=VALUE ...] -- [kvferry-e2e arguments]: runs $B/bench/kvferry-e2e (200 s at
# most, or KVF_TIMEOUT) into $D/NAME.jsonl, prints the rows' headline fields, and appends them to
# $D/rows.jsonl with "variant": NAME (what scripts/device/e2e_sdpa.py and bench/plot.py read).
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

# kvf_route_rows NAME MODES [kvferry-e2e arguments]: the scheduler's routes of MODES, one run each:
# NAME_gpu (route gpu), NAME_auto (route auto: the split, its share following the steps) and
# NAME_cpu (every miss on the CPU: route auto with --split-share 1).
kvf_route_rows() {
  local n=$1 m=$2; shift 2
  kvf_e2e "${n}_gpu" -- --modes "$m" "$@" --route gpu
  kvf_e2e "${n}_auto" -- --modes "$m" "$@" --route auto
  kvf_e2e "${n}_cpu" -- --modes "$m" "$@" --route auto --split-share 1
}

# kvf_rows: a line per row of $D/rows.jsonl (the step's time in a CUDA graph and eager, the split,
# tokens/s, device bytes, fill time, or why the row was skipped).
kvf_rows() {
  python3 - "$D/rows.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    ms = r.get("ms_per_token_step")
    print(r.get("variant"), r.get("mode"), r.get("context"), "b%s" % r.get("batch"),
          "graph %.3f no_graph %.3f" % (ms or -1, r.get("ms_per_token_step_no_graph", -1)),
          "split/step", r.get("decode_split_per_step"), "share", r.get("split_share"),
          "tokens/s %.0f" % (r["batch"] * 1e3 / ms) if ms else "", "gpu_bytes", r.get("gpu_bytes"),
          "fill_s", r.get("fill_s"), r.get("skipped", ""))
PY
}
