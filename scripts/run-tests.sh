#!/usr/bin/env bash
# The README's test command: installs what is missing, fetches the test data (the real model and
# text; the real-model tests skip with a message if that fails), builds and runs every test.
# Works with or without a GPU (GPU tests skip cleanly without one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
if [ -f scripts/fetch-data.sh ]; then
  bash scripts/fetch-data.sh || echo "run-tests: data fetch failed; real-model tests will skip" >&2
fi
build=${KVFERRY_BUILD_DIR:-build}
jobs=$(nproc)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${KVFERRY_CMAKE_ARGS:-}
cmake --build "$build" -j"$jobs"
ctest --test-dir "$build" --output-on-failure -j"$jobs" --timeout 900
