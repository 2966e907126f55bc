#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Where a device policy's decode step goes, kernel by kernel, in the steady state.

Runs kvferry-e2e for one mode under Nsight Compute (ncu, clocks left alone) and records, for the
launches of one decode layer averaged over the layers of a few steady-state token steps (after
--skip-steps token steps of warm-up, so that the token bank is warm and the first step's full
gather is behind), each kernel's duration and its DRAM bytes read and written, the bytes over the
time and that rate's fraction of the HBM rate measured in the same run (torch: a device-to-device
copy of 1 GiB, read + written bytes over its time). The step kernel's rows from the host store
(the bank's misses, from the e2e row of the same run: rows_fetched_per_step over the layers, times
a row's K and V bytes) over the step kernel's time give the miss path's rate against the PCIe rate
kvferry measured at Create (cost_h2d_gbps).

ncu serialises the kernels, so a layer's sum here has no launch gaps and no overlap: it is what the
kernels cost, not the step's time (the e2e row beside it has that).

  python3 bench/kernel_profile.py --e2e build/bench/kvferry-e2e --mode sparcas_bank \
      --context 131072 --batch 1 --json OUT.json [--skip-steps 24] [--steps 2]
"""
import argparse
import csv
import io
import json
import os
import re
import statistics
import subprocess
import sys

# Kernels of the prefill and of the e2e bench's own fill, left out of the decode layer.
PREFILL = re.compile(r"Prefill|StageChunk|StageHistory|Fill|Init|Random|Convert")
METRICS = "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum"
# The decode layer's kernels (the step, the bank, the policies' selections).
DECODE = "StepAttn|StepAppend|Admit|Bank|Combine|Sparcas|Mcta|TopK|Psaw|Hip|Kvpop|Quest|Page|Bound|Select|Knorm|Score|Gather"


def hbm_gbps():
    """Device-to-device copy of 1 GiB with torch, best of 5: (read + written bytes) / time."""
    try:
        import torch
    except ImportError:
        return None
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    best = None
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ms = s.elapsed_time(e)
        best = ms if best is None else min(best, ms)
    return 2 * n / (best * 1e-3) / 1e9


def short(name):
    name = re.sub(r"\(.*", "", name)
    for p in ("(anonymous namespace)::", "kvferry::cuda::", "void ", "<unnamed>::", "unnamed>::"):
        name = name.replace(p, "")
    return name.strip()


def run_ncu(e2e, args, skip, count, log):
    """ncu over kvferry-e2e: parse_ncu_csv's launches."""
    cmd = ["ncu", "--clock-control", "none", "--metrics", METRICS, "--csv", "--page", "raw",
           "--kernel-name", f"regex:{DECODE}",
           "--launch-skip", str(skip), "--launch-count", str(count), e2e] + args
    p = subprocess.run(cmd, capture_output=True, text=True)
    with open(log, "a") as f:
        f.write(" ".join(cmd) + "\n" + p.stderr[-4000:] + "\n")
    launches = parse_ncu_csv(p.stdout)
    if not launches:
        sys.exit(f"kernel_profile: ncu gave no rows (rc {p.returncode}); see {log}")
    return launches


def parse_ncu_csv(text):
    """ncu --csv --page raw output: (kernel, ns, DRAM bytes read, written, grid, block) per launch,
    the prefill's kernels left out."""
    lines = [l for l in text.splitlines() if l.startswith('"')]
    if not lines:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    hdr, data = rows[0], [r for r in rows[1:] if r and r[0].isdigit()]
    ix = {k: hdr.index(k) for k in ("Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum",
                                    "dram__bytes_write.sum", "Grid Size", "Block Size")}
    num = lambda s: float(s.replace(",", "")) if s else 0.0
    out = []
    for r in data:
        n = short(r[ix["Kernel Name"]])
        if PREFILL.search(n):
            continue
        out.append({"kernel": n, "ns": num(r[ix["gpu__time_duration.sum"]]),
                    "read": num(r[ix["dram__bytes_read.sum"]]), "write": num(r[ix["dram__bytes_write.sum"]]),
                    "grid": r[ix["Grid Size"]], "block": r[ix["Block Size"]]})
    return out


def layers_of(launches, anchor):
    """The launch sequence cut into layers, each ending at the anchor kernel (the step kernel): the
    launches after one step kernel up to and including the next. What follows a layer's step
    kernel (the bank's admission) is counted with the next layer; the sum a layer is the same."""
    starts = [i for i, l in enumerate(launches) if l["kernel"].startswith(anchor)]
    return [launches[a + 1:b + 1] for a, b in zip(starts, starts[1:])]


def miss_bytes_per_layer(e2e_row, num_layers):
    """The bank's misses a layer: K and V rows of head_dim 128 in bf16 (kvferry-e2e's
    Llama-3.1-8B shape)."""
    return e2e_row.get("rows_fetched_per_step", 0) / num_layers * (2 * 128 * 2)


def summarize(launches, e2e_row, hbm, num_layers):
    """Per kind of layer (its kernels' names), each kernel averaged over the layers of that kind."""
    # Layers of one kind launch the same kernels (a policy's dense first layers differ from the
    # rest): each kind is averaged on its own, position by position.
    kinds = {}
    for l in layers_of(launches, "StepAttnKernel"):
        kinds.setdefault(tuple(x["kernel"] for x in l), []).append(l)
    if not kinds:
        sys.exit("kernel_profile: no whole layer profiled")
    pcie = e2e_row.get("cost_h2d_gbps")
    miss_bytes = miss_bytes_per_layer(e2e_row, num_layers)
    out_kinds = []
    for sig, layers in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        kernels = []
        for i, name in enumerate(sig):
            xs = [l[i] for l in layers]
            us = statistics.mean(x["ns"] for x in xs) / 1e3
            rd = statistics.mean(x["read"] for x in xs)
            wr = statistics.mean(x["write"] for x in xs)
            gbps = (rd + wr) / (us * 1e-6) / 1e9 if us > 0 else 0.0
            kernels.append({"kernel": name, "grid": xs[0]["grid"], "block": xs[0]["block"],
                            "us": round(us, 2), "us_min": round(min(x["ns"] for x in xs) / 1e3, 2),
                            "us_max": round(max(x["ns"] for x in xs) / 1e3, 2),
                            "dram_read_bytes": round(rd), "dram_write_bytes": round(wr), "dram_gbps": round(gbps, 1),
                            "hbm_fraction": round(gbps / hbm, 3) if hbm else None})
        step = next(k for k in kernels if k["kernel"].startswith("StepAttnKernel"))
        miss_gbps = miss_bytes / (step["us"] * 1e-6) / 1e9
        out_kinds.append({"layers_profiled": len(layers), "launches": len(sig),
                          "us_kernels": round(sum(k["us"] for k in kernels), 2),
                          "us_select": round(sum(k["us"] for k in kernels
                                                 if not re.match(r"StepAttn|Admit|StepAppend|Combine", k["kernel"])), 2),
                          "miss_gbps_over_step_kernel": round(miss_gbps, 2),
                          "miss_pcie_fraction": round(miss_gbps / pcie, 3) if pcie else None,
                          "kernels": kernels})
    return out_kinds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--e2e", required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--query", default="real")
    ap.add_argument("--skip-steps", type=int, default=24, help="token steps of warm-up left out")
    ap.add_argument("--steps", type=int, default=2, help="token steps profiled")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--extra", default="", help="more kvferry-e2e arguments")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    tmp = a.json + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    log = os.path.join(tmp, "ncu.log")
    # kvferry-e2e runs its steps three times (eager, in a CUDA graph, the selection timed alone)
    # after the first step, so --steps S gives about 3 S + 1 token steps of launches.
    e2e_steps = (a.skip_steps + a.steps) // 3 + 2
    base = ["--modes", a.mode, "--contexts", str(a.context), "--batches", str(a.batch), "--query", a.query,
            "--unique-kv", "--steps", str(e2e_steps)] + a.extra.split()
    # Launches a layer: from a short profile of the first layers.
    probe = run_ncu(a.e2e, base + ["--json", os.path.join(tmp, "probe.jsonl")], 0, 200, log)
    lay = layers_of(probe, "StepAttnKernel")
    if not lay:
        sys.exit("kernel_profile: no StepAttnKernel in the first launches")
    per_layer = max(len(l) for l in lay)
    skip = a.skip_steps * a.layers * per_layer
    count = a.steps * a.layers * per_layer
    launches = run_ncu(a.e2e, base + ["--json", os.path.join(tmp, "e2e.jsonl")], skip, count + per_layer, log)
    e2e_row = json.loads(open(os.path.join(tmp, "e2e.jsonl")).readline())
    hbm = hbm_gbps()
    out_kinds = summarize(launches, e2e_row, hbm, a.layers)
    d = {"bench": "kernel_profile", "mode": a.mode, "context": a.context, "batch": a.batch, "query": a.query,
         "skip_steps": a.skip_steps, "hbm_gbps_measured": round(hbm, 1) if hbm else None,
         "pcie_gbps_measured": e2e_row.get("cost_h2d_gbps"),
         "miss_bytes_per_layer": round(miss_bytes_per_layer(e2e_row, a.layers)),
         "e2e": {k: e2e_row.get(k) for k in ("ms_per_token_step", "ms_select_device_per_step",
                                             "ms_attend_device_per_step", "bank_hit_rate",
                                             "rows_fetched_per_step", "rows_selected_per_step")},
         "layer_kinds": out_kinds,
         "launches": [[x["kernel"], round(x["ns"] / 1e3, 2), round(x["read"]), round(x["write"])] for x in launches]}
    with open(a.json, "w") as f:
        json.dump(d, f, indent=1)
    for k in out_kinds:
        print(f"{a.mode} {a.context}x{a.batch}, {k['layers_profiled']} layers of {k['launches']} launches: kernels "
              f"{k['us_kernels']} us (selection {k['us_select']}), misses {k['miss_gbps_over_step_kernel']} GB/s "
              f"over the step kernel")
        for x in k["kernels"]:
            print(f"  {x['kernel'][:60]:60s} {x['us']:8.2f} us  {x['dram_gbps']:8.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
