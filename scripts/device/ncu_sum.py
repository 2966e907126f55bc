#!/usr/bin/env python3
"""Sums an ncu --csv --page raw log of gpu__time_duration.sum by kernel, per decode step.

usage: ncu_sum.py LOG.csv[.gz] LAYERS. A decode step ends at its LAYERS-th StepAttnKernel launch;
the fill, copy and prefill kernels are left out. Prints each step's total and the last step's
kernels (the steady state: the first steps fill the compact rows and the bank).
"""
import csv
import gzip
import re
import sys
from collections import defaultdict

path, layers = sys.argv[1], int(sys.argv[2])
opener = gzip.open if path.endswith(".gz") else open
with opener(path, "rt", newline="") as f:
    lines = [l for l in f if l.startswith('"')]
seq = []
for r in csv.DictReader(lines):
    try:
        d = float(r.get("gpu__time_duration.sum", "").replace(",", ""))
    except ValueError:
        continue  # the units row (ns)
    name = re.sub(r"^void ", "", r.get("Kernel Name", ""))
    name = re.sub(r"\(kvferry::.*$|\(const .*$|\(unsigned .*$", "", name)
    name = re.sub(r"kvferry::|<unnamed>::", "", name).strip()
    seq.append((name, d / 1e3))
skip = ("CopyRowsKernel", "FillBf16", "PrefillAttnKernel")
ends = [i for i, (n, _) in enumerate(seq) if n.startswith("StepAttnKernel")][layers - 1::layers]
prev, steps = 0, []
for e in ends:
    agg = defaultdict(lambda: [0, 0.0])
    for n, d in seq[prev:e + 1]:
        if not n.startswith(skip):
            agg[n][0] += 1
            agg[n][1] += d
    steps.append(agg)
    prev = e + 1
for i, agg in enumerate(steps):
    print(f"step {i}: {sum(v[1] for v in agg.values()):9.1f} us of kernels")
last = steps[-1]
print(f"last step, serialised kernel time {sum(v[1] for v in last.values()):.1f} us:")
for n, (c, s) in sorted(last.items(), key=lambda kv: -kv[1][1]):
    print(f"  {n[:64]:64s} {c:4d} x {s / c:7.2f} us = {s:8.1f} us")
