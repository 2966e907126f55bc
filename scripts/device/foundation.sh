#!/usr/bin/env bash
# Foundation numbers on the GPU machine's CPU (host backend): every policy at full budget against
# dense (rel_err), and streaming / oracle / lfps at budget 256 on the synthetic workload. One JSON
# object per line in $OUT/foundation.jsonl.
set -u
BUILD=${BUILD:-build-gpu}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
f="$OUT/foundation.jsonl"
: > "$f"
bench="$BUILD/bench/kvferry-bench"
for p in dense streaming oracle lfps; do
  "$bench" --policy $p --budget 100000 --context 8192 --steps 8 --backend host 2>/dev/null >> "$f"
done
for p in streaming oracle lfps; do
  for b in 256 512; do
    "$bench" --policy $p --budget $b --context 8192 --steps 32 --backend host 2>/dev/null >> "$f"
  done
done
python3 - "$f" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print(f"{d['policy']:10s} budget {d['budget']:>8} ctx {d['context']} recall {d['recall']:.4f} "
          f"mass_recall {d['mass_recall']:.4f} rel_err {d['rel_err']:.3g} ms/step {d['ms_per_step']:.2f} "
          f"h2d/token {d['bytes_h2d_per_token']:.0f}")
PY
