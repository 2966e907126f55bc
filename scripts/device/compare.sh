#!/usr/bin/env bash
# Copyright kvferry authors. Apache-2.0.
# On the GPU machine: the same kvferry-e2e rows from two source trees in one call, with torch SDPA
# in the same run: BASE (another tree, e.g. a commit exported with
# `git archive COMMIT | tar -x -C build-base/src` and carried) against this checkout. Each row runs
# base then new back to back, so both see the same machine state. Results under $OUT (three files:
# the device tool returns at most eight): rows.jsonl (every row tagged "variant": base|new),
# compare.json (with SDPA's time and the ratios) and summary.txt; each run's own files and logs stay
# in $W. A row takes its fill plus the steps: about 2 s at 32K b1, 8 s at 128K b1 and 31 s at 128K
# b4 on the H200, so the default 4 modes x 2 contexts x 2 batches x 2 trees take about 6 minutes.
#   BASE=build-base/src MODES=sparcas_bank,hip_bank CONTEXTS=32768,131072 BATCHES=1,4 \
#   STEPS=8 DRIFT=0 EXTRA="--unique-kv" bash scripts/device/compare.sh
#   --no-build: use the binaries already in $B and $B0.
set -u
BASE=${BASE:?BASE: the other source tree}
export B=${B:-/tmp/b} B0=${B0:-/tmp/b0}
OUT=${OUT:-/tmp/compare}
W=${W:-/tmp/compare-work}
D=$W
mkdir -p "$OUT" "$W"
source scripts/device/build.sh
if [ "${1:-}" != "--no-build" ]; then
  cmake -S "$BASE" -B "$B0" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS=90 \
    -DKVFERRY_BUILD_EXAMPLES=OFF > "$D/cmake_base.log" 2>&1 &&
    cmake --build "$B0" -j8 --target kvferry-e2e > "$D/build_base.log" 2>&1 &
  base_pid=$!
  kvf_build kvferry-e2e
  wait $base_pid || { echo "base build failed"; grep -E "error|FAILED" "$D/build_base.log" | head -20; exit 1; }
  echo "both built: $(( $(date +%s) - t0 )) s"
fi
: > "$OUT/rows.jsonl"  # appended row by row: a run cut short keeps what it measured
IFS=, read -ra modes <<< "${MODES:-sparcas_bank,hip_bank,kvpop_bank,quest_bank}"
IFS=, read -ra ctxs <<< "${CONTEXTS:-32768,131072}"
IFS=, read -ra batches <<< "${BATCHES:-1,4}"
for c in "${ctxs[@]}"; do
  for b in "${batches[@]}"; do
    for m in "${modes[@]}"; do
      for v in base new; do
        bin="$B/bench/kvferry-e2e"; [ $v = base ] && bin="$B0/bench/kvferry-e2e"
        f="$D/${v}_${m}_${c}_${b}.jsonl"
        timeout "${KVF_TIMEOUT:-120}" "$bin" --modes "$m" --contexts "$c" --batches "$b" \
          --steps "${STEPS:-8}" --query-drift "${DRIFT:-0}" ${EXTRA:-} --json "$f" > "$f.log" 2>&1 ||
          echo "$v $m $c b$b failed: $(tail -2 "$f.log")"
        [ -s "$f" ] && kvf_tag "$f" "$v" >> "$OUT/rows.jsonl"
      done
    done
  done
done
python3 scripts/device/e2e_sdpa.py "$OUT/rows.jsonl" "$OUT/compare.json" > "$D/sdpa.log" 2>&1 ||
  { echo "SDPA failed"; tail -5 "$D/sdpa.log"; }
python3 - "$OUT/compare.json" > "$OUT/summary.txt" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"] if isinstance(d, dict) else d
by = {}
for r in rows:
    by.setdefault((r.get("mode"), r.get("context"), r.get("batch")), {})[r.get("variant")] = r
print("mode context batch | base ms | new ms | new/base | SDPA ms | base/SDPA new/SDPA")
for (m, c, b), v in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    o, n = v.get("base", {}), v.get("new", {})
    bo, bn = o.get("ms_per_token_step"), n.get("ms_per_token_step")
    s = n.get("sdpa_ms_per_token_step") or o.get("sdpa_ms_per_token_step")
    f = lambda x: "%.3f" % x if isinstance(x, (int, float)) else "-"
    print(m, c, b, "|", f(bo), "|", f(bn), "|", f(bn / bo if bo and bn else None), "|", f(s), "|",
          f(o.get("ratio")), f(n.get("ratio")))
PY
cat "$OUT/summary.txt"
echo "total: $(( $(date +%s) - t0 )) s"
