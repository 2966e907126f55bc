#!/usr/bin/env bash
# Before/after table of dense prefill on the host backend (bench/micro/prefill_host_bench: one
# layer through Runtime::Prefill, Llama-3.1-8B and SmolLM2-135M attention shapes). Builds the bench
# twice, against the library of the base commit (default 25b9260, the host prefill path before the
# oneDNN-chunked rewrite; the working tree's bench source is copied in, so both sides run the same
# benchmark) and against the working tree, runs the two alternately
# --rounds times (so load from other processes falls on both) and writes the best run of each as
# JSON rows {shape, tokens, chunk, before_tokens_per_s, after_tokens_per_s, speedup, gflops, ...}.
#
# Usage: scripts/prefill-host-bench.sh [--base COMMIT] [--llama-tokens 2048,8192,32768]
#          [--smollm2-tokens 2048,8192] [--rounds 2] [--threads N] [--out FILE]
#          [--base-bin B --new-bin N]
#          [--llama-context N [--base-llama B --new-llama N]]
#          [--merge-only 1]
# --base-bin/--new-bin: use these prefill_host_bench binaries instead of building them.
# --merge-only 1: build and run nothing; rewrite the table from the runs already in BUILD_ROOT.
# --llama-context N: also time the main job's prompt prefill, kvferry-llama --perplexity on SmolLM2
# (data/ from scripts/fetch-data.sh) over an N-token window of data/kjv.txt on the host backend,
# before and after (built here unless --base-llama/--new-llama give the binaries); the rows go to
# "llama_prefill" of the JSON.
# Default output: bench/results/prefill_host_<nproc>core.json. Environment: BUILD_ROOT (default
# /tmp/kvferry-prefill-bench), JOBS (default: all cores). Needs the build dependencies of the repo
# (scripts/install-deps.sh) and python3.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base=25b9260
llama_tokens=2048,8192,32768
smollm2_tokens=2048,8192
rounds=2
threads=0
out=""
base_bin=""
new_bin=""
llama_context=0
merge_only=0
base_llama=""
new_llama=""
while [[ $# -gt 0 ]]; do
  [[ $# -ge 2 ]] || { echo "$0: $1 needs a value" >&2; exit 2; }
  case "$1" in
    --base) base="$2" ;;
    --llama-tokens) llama_tokens="$2" ;;
    --smollm2-tokens) smollm2_tokens="$2" ;;
    --rounds) rounds="$2" ;;
    --threads) threads="$2" ;;
    --out) out="$2" ;;
    --base-bin) base_bin="$2" ;;
    --new-bin) new_bin="$2" ;;
    --llama-context) llama_context="$2" ;;
    --merge-only) merge_only="$2" ;;
    --base-llama) base_llama="$2" ;;
    --new-llama) new_llama="$2" ;;
    *) echo "usage: $0 [--base COMMIT] [--llama-tokens LIST] [--smollm2-tokens LIST]" \
            "[--rounds N] [--threads N] [--out FILE] [--base-bin B --new-bin N]" >&2
       exit 2 ;;
  esac
  shift 2
done
cores="$(nproc)"
[[ -n "$out" ]] || out="$repo/bench/results/prefill_host_${cores}core.json"
root="${BUILD_ROOT:-/tmp/kvferry-prefill-bench}"
jobs="${JOBS:-$cores}"
log() { echo "[prefill-host-bench] $*" >&2; }

want_llama=0
[[ $llama_context -gt 0 && ( -z "$base_llama" || -z "$new_llama" ) ]] && want_llama=1
build() {  # source dir, build dir
  local examples=OFF targets=(prefill_host_bench)
  if [[ $want_llama == 1 ]]; then examples=ON; targets+=(kvferry-llama); fi
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_WITH_CUDA=OFF \
    -DKVFERRY_BUILD_TESTS=OFF -DKVFERRY_BUILD_EXAMPLES="$examples" >/dev/null
  cmake --build "$2" -j "$jobs" --target "${targets[@]}" >/dev/null
}

mkdir -p "$root"
if [[ $merge_only == 1 ]]; then
  log "merging the runs in $root"
else
if [[ -z "$base_bin" || ( $want_llama == 1 && -z "$base_llama" ) ]]; then
  log "building the base ($base) in $root/base-build"
  rm -rf "$root/base-src"
  mkdir -p "$root/base-src"
  if [[ -n "${BASE_TAR:-}" ]]; then  # a `git archive` of the base, where there is no .git
    tar -x -C "$root/base-src" -f "$BASE_TAR"
  else
    git -C "$repo" archive "$base" | tar -x -C "$root/base-src"
  fi
  cp "$repo/bench/micro/prefill_host_bench.cpp" "$root/base-src/bench/micro/"
  build "$root/base-src" "$root/base-build"
  [[ -n "$base_bin" ]] || base_bin="$root/base-build/bench/prefill_host_bench"
  [[ -n "$base_llama" ]] || base_llama="$root/base-build/examples/llama/kvferry-llama"
fi
if [[ -z "$new_bin" || ( $want_llama == 1 && -z "$new_llama" ) ]]; then
  log "building the working tree in $root/new-build"
  build "$repo" "$root/new-build"
  [[ -n "$new_bin" ]] || new_bin="$root/new-build/bench/prefill_host_bench"
  [[ -n "$new_llama" ]] || new_llama="$root/new-build/examples/llama/kvferry-llama"
fi
if [[ $llama_context -gt 0 && ! -f "$repo/data/SmolLM2-135M-Instruct.Q4_1.gguf" ]]; then
  "$repo/scripts/fetch-data.sh"
fi

for ((r = 1; r <= rounds; r++)); do
  for side in base new; do
    log "round $r/$rounds: $side"
    bin="$base_bin"
    [[ $side == new ]] && bin="$new_bin"
    for shape in llama8b smollm2; do
      list="$llama_tokens"
      [[ $shape == smollm2 ]] && list="$smollm2_tokens"
      "$bin" --shapes "$shape" --tokens "$list" --threads "$threads" --label "$side" \
        --json "$root/$side-$r-$shape.json"
    done
  done
done

if [[ $llama_context -gt 0 ]]; then
  for ((r = 1; r <= rounds; r++)); do
    for side in base new; do
      log "round $r/$rounds: kvferry-llama $side, context $llama_context"
      bin="$base_llama"
      [[ $side == new ]] && bin="$new_llama"
      cpu_flag=()
      [[ $threads -gt 0 ]] && cpu_flag=(--cpu-threads "$threads")
      "$bin" --model "$repo/data/SmolLM2-135M-Instruct.Q4_1.gguf" --text "$repo/data/kjv.txt" \
        --perplexity --context "$llama_context" --scored 16 --offset-lines 1000 \
        --policy streaming --no-dense --backend host "${cpu_flag[@]}" \
        --json "$root/llama-$side-$r.json" | grep "shared prefill" >&2
    done
  done
fi
fi  # merge_only

python3 - "$root" "$rounds" "$out" "$base" "$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo "${HEAD_REV:-unknown}")" \
  "$llama_context" <<'EOF'
import json, os, sys
root, rounds, out, base, head = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
llama_context = int(sys.argv[6])
best = {}
meta = {}
for side in ("base", "new"):
    for r in range(1, rounds + 1):
        for shape in ("llama8b", "smollm2"):
            d = json.load(open(os.path.join(root, f"{side}-{r}-{shape}.json")))
            meta[side] = d
            for row in d["rows"]:
                key = (row["shape"], row["tokens"], row["chunk"])
                cur = best.setdefault(side, {}).get(key)
                if cur is None or row["tokens_per_s"] > cur["tokens_per_s"]:
                    best[side][key] = row
cpu = ""
try:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
except OSError:
    pass
rows = []
for key, a in best["new"].items():
    b = best["base"].get(key)
    rows.append({
        "shape": key[0], "tokens": key[1], "chunk": key[2],
        "before_tokens_per_s": round(b["tokens_per_s"], 1) if b else None,
        "after_tokens_per_s": round(a["tokens_per_s"], 1),
        "speedup": round(a["tokens_per_s"] / b["tokens_per_s"], 2) if b else None,
        "before_gflops": round(b["gflops"], 1) if b else None,
        "gflops": round(a["gflops"], 1),
        "before_seconds": round(b["seconds"], 3) if b else None,
        "after_seconds": round(a["seconds"], 3),
    })
doc = {
    "bench": "prefill_host (bench/micro/prefill_host_bench, scripts/prefill-host-bench.sh)",
    "cpu": cpu, "hardware_threads": meta["new"]["hardware_threads"],
    "cpu_threads": meta["new"]["cpu_threads"], "cpu_isa": meta["new"]["cpu_isa"],
    "before_commit": base, "after_commit": head, "rounds": rounds,
    "note": "best of the rounds; base and new runs alternate",
    "rows": rows,
}
if llama_context > 0:
    rate = {}
    for side in ("base", "new"):
        for r in range(1, rounds + 1):
            d = json.load(open(os.path.join(root, f"llama-{side}-{r}.json")))
            tps = d["prefill_tokens"] / d["prefill_seconds"]
            rate[side] = max(rate.get(side, 0.0), tps)
            tokens = d["prefill_tokens"]
    doc["llama_prefill"] = {
        "what": "kvferry-llama --perplexity, SmolLM2-135M-Instruct Q4_1, KV f16, chunks of 512, "
                "host backend: whole-model prompt prefill (attention and the model's matmuls)",
        "context": llama_context, "prefill_tokens": tokens,
        "before_tokens_per_s": round(rate["base"], 1), "after_tokens_per_s": round(rate["new"], 1),
        "speedup": round(rate["new"] / rate["base"], 2)}
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
print(f"{'shape':8} {'tokens':>7} {'chunk':>6} {'before tok/s':>13} {'after tok/s':>12} {'speedup':>8} {'GFLOP/s':>8}")
for r in rows:
    print(f"{r['shape']:8} {r['tokens']:7d} {r['chunk']:6d} {r['before_tokens_per_s'] or 0:13.1f} "
          f"{r['after_tokens_per_s']:12.1f} {r['speedup'] or 0:8.2f} {r['gflops']:8.1f}")
if llama_context > 0:
    lp = doc["llama_prefill"]
    print(f"kvferry-llama prefill, {lp['prefill_tokens']} tokens: {lp['before_tokens_per_s']} -> "
          f"{lp['after_tokens_per_s']} tok/s ({lp['speedup']}x)")
print(f"written: {out}")
EOF
