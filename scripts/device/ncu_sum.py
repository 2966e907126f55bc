#!/usr/bin/env python3
"""Sums an ncu --csv --page raw log of gpu__time_duration.sum by kernel name.

usage: ncu_sum.py LOG.csv LAYERS -> per kernel: launches, total us, us per (layers x launches of
the most frequent per-layer kernel) step estimate. The e2e runs several steps; the last third of
launches (the timed steps) is what is summed when the log holds the warm-up too.
"""
import csv
import re
import sys
from collections import defaultdict

path, layers = sys.argv[1], int(sys.argv[2])
rows = []
with open(path, newline="") as f:
    lines = [l for l in f if l.startswith('"')]
reader = csv.DictReader(lines)
for r in reader:
    name = r.get("Kernel Name") or r.get("Function Name") or ""
    dur = r.get("gpu__time_duration.sum", "")
    try:
        d = float(dur.replace(",", ""))
    except ValueError:
        print("unit row:", dur)
        continue
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"^void ", "", name)
    name = name.split("<")[0].split("::")[-1]
    rows.append((name, d))
unit = "ns"
print(f"{len(rows)} launches")
# The whole log by name, then the last 1/3 (the timed step of --steps 1 runs 3*1+7 steps).
tail = rows[-(len(rows) // 10):] if len(rows) > 100 else rows
for label, sel in (("all", rows), ("last tenth", tail)):
    agg = defaultdict(lambda: [0, 0.0])
    for n, d in sel:
        agg[n][0] += 1
        agg[n][1] += d
    tot = sum(v[1] for v in agg.values())
    print(f"== {label}: {len(sel)} launches, {tot/1e3:.1f} us")
    for n, (c, s) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {n:40s} {c:6d} x {s/c/1e3:8.2f} us = {s/1e3:10.1f} us")
