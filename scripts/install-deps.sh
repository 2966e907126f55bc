#!/usr/bin/env bash
# Installs the Debian packages kvferry builds with, if any is missing. Needs root (or sudo) the
# first time; a no-op when everything is there.
#   ocl-icd-opencl-dev, opencl-headers: oneDNN's CMake package looks for OpenCL; libdnnl-dev only
#     recommends them, so an install without recommends lacks them and configuring fails.
#   clang, libclang-rt-14-dev: libFuzzer and clang's sanitizer runtimes for the fuzz stage of
#     scripts/run-tests.sh (gcc's ASan/UBSan/TSan runtimes come with g++). Skipped when
#     KVFERRY_FUZZ=0 or KVFERRY_SANITIZE=0.
#   dpkg-dev: dpkg-source, to unpack Debian's oneTBB source package for the TSan stage
#     (scripts/build-tsan-tbb.sh). Skipped when KVFERRY_TSAN=0.
set -euo pipefail
pkgs=(g++ cmake ninja-build pkg-config libtbb-dev libdnnl-dev ocl-icd-opencl-dev opencl-headers
      libboost-dev libhwloc-dev libgtest-dev libgmock-dev libbenchmark-dev python3 ca-certificates)
# python3-venv, python3-dev: the Python stage (pip install . of the kvferry package, pytest).
if [ "${KVFERRY_PYTHON:-1}" != 0 ]; then
  pkgs+=(python3-venv python3-dev)
fi
if [ "${KVFERRY_FUZZ:-${KVFERRY_SANITIZE:-1}}" != 0 ]; then
  pkgs+=(clang libclang-rt-14-dev)
fi
if [ "${KVFERRY_TSAN:-1}" != 0 ]; then
  pkgs+=(dpkg-dev)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
