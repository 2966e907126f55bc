#!/usr/bin/env bash
# Installs the Debian packages kvferry builds with, if any is missing. Needs root (or sudo) the
# first time; a no-op when everything is there.
set -euo pipefail
pkgs=(g++ cmake ninja-build pkg-config libtbb-dev libdnnl-dev libboost-dev libhwloc-dev
      libgtest-dev libgmock-dev libbenchmark-dev python3 ca-certificates)
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
