#!/usr/bin/env bash
# The runtime end to end on the GPU machine: kvferry-bench on the CUDA backend, Llama-3.1-8B
# attention shape (32 q / 8 KV heads, head_dim 128, bf16), one layer, 32K context, 32 decode steps,
# synthetic workload, every mode in one run. One JSON object per line in $OUT/runtime_cuda.jsonl.
set -u
BUILD=${BUILD:-build-gpu}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
f="$OUT/runtime_cuda.jsonl"
: > "$f"
b="$BUILD/bench/kvferry-bench"
common="--backend cuda --context 32768 --steps 32 --layers 1 --window 256"
run() { echo "== $*" >&2; "$b" $common "$@" 2>/dev/null >> "$f" || echo "failed: $*" >&2; }
run --policy dense --budget 100000 --route gpu          # every row streamed over PCIe (baseline)
run --policy dense --budget 100000 --route cpu          # dense on the CPU cores (llama.cpp-style)
run --policy streaming --budget 1024 --route gpu
run --policy oracle --budget 1024 --route gpu
run --policy oracle --budget 1024 --route cpu
run --policy oracle --budget 1024 --route auto
run --policy oracle --budget 1024 --route gpu --bank-slots 4096 --bank-map vector
run --policy oracle --budget 1024 --route gpu --bank-slots 4096 --bank-map hash
run --policy lfps --budget 0.02 --route auto
run --policy lfps --budget 0.02 --route gpu
python3 - "$f" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line); s = d["stats"]
    print(f"{d['policy']:9s} b={d['budget']:<7} route={d['route']:4s} bank={s['rows_bank_hit']:>7} "
          f"recall={d['recall']:.3f} mass={d['mass_recall']:.3f} rel_err={d['rel_err']:.2e} "
          f"ms/step={d['ms_per_step']:.3f} h2d/tok={d['bytes_h2d_per_token']:.0f} "
          f"select={s['ms_select']/d['steps']:.3f} gpu={s['ms_attend_gpu']/d['steps']:.3f} "
          f"cpu={s['ms_attend_cpu']/d['steps']:.3f}")
PY
