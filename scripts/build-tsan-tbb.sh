#!/usr/bin/env bash
# Builds oneTBB with ThreadSanitizer for the TSan stage of scripts/run-tests.sh:
#   bash scripts/build-tsan-tbb.sh DIR
# leaves an install prefix in DIR/prefix (use -DTBB_DIR=DIR/prefix/lib/cmake/TBB) and does nothing
# when it is already there for the same source version.
#
# Why: Debian's libtbb is not instrumented, so TSan cannot see the synchronisation inside TBB's
# arenas and task queues and reports every hand-off of work to a worker as a race. A libtbb built
# with -fsanitize=thread (oneTBB's own TBB_SANITIZE=thread, which also turns on its TSan
# annotations) makes those hand-offs visible.
#
# Source: Debian's own source package of the installed libtbb-dev (onetbb, patches applied by
# dpkg-source), fetched with apt-get source through a private apt configuration under DIR (deb-src
# entries for the system's archives and their own package lists), so the system's apt sources
# are left as they are and no root is needed. Only libtbb is built (no tbbmalloc, tbbbind, tests):
# about 40 s on 2 idle cores.
set -euo pipefail
dir=$(realpath -m "${1:?usage: build-tsan-tbb.sh DIR}")
prefix=$dir/prefix
want=$(dpkg-query -W -f='${Version}' libtbb-dev 2>/dev/null || echo "")
if [ -f "$prefix/lib/cmake/TBB/TBBConfig.cmake" ] && [ -f "$dir/stamp" ] &&
   [ "$(cat "$dir/stamp")" = "$want" ]; then
  echo "build-tsan-tbb: TSan-built oneTBB $want already in $prefix" >&2
  exit 0
fi
rm -rf "$dir/src" "$dir/build" "$prefix"
mkdir -p "$dir/apt/lists/partial" "$dir/apt/cache/archives/partial" "$dir/dl"
# deb-src entries for the archives the system installs from (its mirror; proxy settings in
# apt.conf still apply), deb.debian.org when none can be read.
apt-cache policy 2>/dev/null |
  awk '$2 ~ /^(https?|file|ftp):/ && $3 ~ /\/main$/ {split($3, s, "/"); print "deb-src", $2, s[1], "main"}' |
  sort -u >"$dir/apt/sources.list"
if [ ! -s "$dir/apt/sources.list" ]; then
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
  cat >"$dir/apt/sources.list" <<EOF
deb-src http://deb.debian.org/debian $codename main
deb-src http://deb.debian.org/debian $codename-updates main
deb-src http://deb.debian.org/debian-security $codename-security main
EOF
fi
apt_opts=(-o "Dir::Etc::SourceList=$dir/apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$dir/apt/lists" -o "Dir::Cache=$dir/apt/cache"
          -o "Debug::NoLocking=1" -o "APT::Sandbox::User=$(id -un)")
apt-get "${apt_opts[@]}" -qq update
# The installed version when the archive still has it (same headers as the system's), else the
# archive's current one.
(cd "$dir/dl" && { { [ -n "$want" ] && apt-get "${apt_opts[@]}" -qq source --download-only \
    "onetbb=$want"; } || apt-get "${apt_opts[@]}" -qq source --download-only onetbb; }) >/dev/null
dsc=$(ls "$dir"/dl/onetbb_*.dsc | head -n 1)
# apt checked the files against the archive's signed index; the uploader's signature on the .dsc
# would need debian-keyring, so dpkg-source does not check it again.
dpkg-source --no-check -x "$dsc" "$dir/src" >/dev/null
# RelWithDebInfo at -O1 -g1, as the kvferry TSan build: line numbers in reports, quick to build.
cmake -S "$dir/src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DTBB_SANITIZE=thread -DTBB_TEST=OFF \
  -DTBB_EXAMPLES=OFF -DTBB_STRICT=OFF -DTBBMALLOC_BUILD=OFF -DTBB_DISABLE_HWLOC_AUTOMATIC_SEARCH=ON \
  -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib >/dev/null
cmake --build "$dir/build" -j"$(nproc)" >/dev/null
cmake --install "$dir/build" >/dev/null
basename "$dsc" .dsc | sed 's/^onetbb_//' >"$dir/built-from"
echo "$want" >"$dir/stamp"
echo "build-tsan-tbb: oneTBB $(cat "$dir/built-from") built with -fsanitize=thread into $prefix" >&2
