#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Layers point down: fails (exit 1) on an #include "..." that goes up or sideways in the layer
order below, listing each offending include, or on an allowed exception that no longer occurs.

The order, lowest first (a file may include its own layer and any layer with a lower rank; two
layers of one rank are peers and may not include each other):

  0  include/kvferry   the public API
  1  base              plain types and host/device helpers shared by everything
  2  cpu               host kernels, the CPU pool, NUMA placement
  3  gpu               the Device interface, its host and CUDA implementations, kernels
  4  offload           host store, token bank, transfers (on top of gpu/device.h)
  5  policies          selection policies (host references)
  6  runtime           the runtime: plan, select, resolve, route, attend, merge, admit
  7  python/src, tools/common, bench/lib   users of the library; shared code of the tools
  8  examples, bench   programs
  9  tests

Checked: every .h/.hpp/.cpp/.cu/.cuh/.inc file under those folders that git tracks or would
track (untracked files that .gitignore does not exclude count, so a new file is checked before
it is committed). An include is resolved against the repository root, then the including
file's folder, then include/; one that resolves to none of them (a system or third-party
header) is not checked.

Also checked: the runtime knows no policy. No file under runtime/ names one of the policies that
live in policies/ (a folder there holding a policy: its name, case-insensitive, at the start of a
word, as in "hip", "HipPolicy" or "kvpop_bank"); what is a policy's belongs in its folder, and the
runtime reaches it through Policy and DeviceSelector.

Usage: python3 scripts/check_layers.py [--verbose]
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (path prefix, layer name, rank): the longest matching prefix names a file's layer.
LAYERS = [
    ("include/kvferry/", "include/kvferry", 0),
    ("base/", "base", 1),
    ("cpu/", "cpu", 2),
    ("gpu/", "gpu", 3),
    ("offload/", "offload", 4),
    ("policies/", "policies", 5),
    ("runtime/", "runtime", 6),
    ("python/src/", "python/src", 7),
    ("tools/common/", "tools/common", 7),
    ("bench/lib/", "bench/lib", 7),
    ("examples/", "examples", 8),
    ("bench/", "bench", 8),
    ("tests/", "tests", 9),
]

# Upward includes known and allowed, each (including file, included path as written) with why.
# Anything else that goes up fails; an entry here that no longer occurs fails too (delete it).
ALLOWED = {
    # None at present. gpu/device_bank.h, gpu/bank_map.cuh and cpu/decode_step.cpp read the bank
    # map types from base/bank_map.h, and gpu/host_device.cpp's NUMA binding is cpu/numa.h.
}

EXTENSIONS = (".h", ".hpp", ".cpp", ".cu", ".cuh", ".inc")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(path):
    best = None
    for prefix, name, rank in LAYERS:
        if path.startswith(prefix) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, name, rank)
    return None if best is None else (best[1], best[2])


def files():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for path in sorted(set(out.split("\n"))):
        if path.endswith(EXTENSIONS) and layer_of(path) and os.path.isfile(os.path.join(ROOT, path)):
            yield path


def resolve(including, written):
    for candidate in (written, os.path.join(os.path.dirname(including), written),
                      os.path.join("include", written)):
        candidate = os.path.normpath(candidate)
        if os.path.isfile(os.path.join(ROOT, candidate)):
            return candidate
    return None


def policy_names():
    """The folders of policies/ that hold a policy (weights/ holds data files)."""
    base = os.path.join(ROOT, "policies")
    return sorted(n for n in os.listdir(base)
                  if os.path.isdir(os.path.join(base, n)) and n != "weights")


def policy_mentions():
    """(path:line: text) for every line under runtime/ that names a policy."""
    names = policy_names()
    word = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(names) + ")", re.IGNORECASE)
    out = []
    for path in files():
        if not path.startswith("runtime/"):
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if word.search(line):
                    out.append(f"{path}:{number}: names a policy: {line.strip()}")
    return out


def main():
    verbose = "--verbose" in sys.argv[1:]
    bad, seen_allowed, checked, arrows = [], set(), 0, {}
    for path in files():
        src_name, src_rank = layer_of(path)
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
        checked += 1
        for number, line in enumerate(lines, 1):
            m = INCLUDE_RE.match(line)
            if not m:
                continue
            target = resolve(path, m.group(1))
            dst = layer_of(target) if target else None
            if dst is None:
                continue
            dst_name, dst_rank = dst
            if dst_name == src_name:
                continue
            arrows[(src_name, dst_name)] = arrows.get((src_name, dst_name), 0) + 1
            if dst_rank < src_rank:
                continue
            key = (path, m.group(1))
            if key in ALLOWED:
                seen_allowed.add(key)
                continue
            how = "sideways to a peer" if dst_rank == src_rank else "upward"
            bad.append(f'{path}:{number}: #include "{m.group(1)}" goes {how}: '
                       f"{src_name} (rank {src_rank}) -> {dst_name} (rank {dst_rank})")
    stale = sorted(set(ALLOWED) - seen_allowed)
    named = policy_mentions()
    if verbose:
        for (a, b), count in sorted(arrows.items()):
            print(f"  {a} -> {b}: {count}")
    if bad or stale or named:
        for line in bad + named:
            print(line)
        for path, written in stale:
            print(f'{path}: allowed exception #include "{written}" no longer occurs: '
                  "remove it from ALLOWED in scripts/check_layers.py")
        print(f"check_layers: {len(bad)} include(s) against the layer order, {len(stale)} stale "
              f"exception(s), {len(named)} runtime line(s) naming a policy "
              "(the rules are in scripts/check_layers.py)")
        return 1
    print(f"check_layers: {checked} files, every include points down "
          f"({len(ALLOWED)} allowed exception(s)); runtime/ names none of the "
          f"{len(policy_names())} policies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
