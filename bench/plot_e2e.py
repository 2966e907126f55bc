#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Renders bench/results/e2e_h100.json (kvferry-e2e + torch SDPA) as a PNG next to it: time per
token step (all layers) of each kvferry mode against torch SDPA with all KV on the GPU, per
(context, batch), log scale.

Usage: plot_e2e.py [bench/results/e2e_h100.json] [out.png]
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "bench/results/e2e_h100.json"
    dst = sys.argv[2] if len(sys.argv) > 2 else src.rsplit(".", 1)[0] + ".png"
    d = json.load(open(src))
    rows = [r for r in d["rows"] if "skipped" not in r and r.get("name", "decode") == "decode"]
    points = sorted({(r["context"], r["batch"]) for r in rows})
    modes = ["dense_resident", "streaming_resident", "streaming", "quest", "sparcas", "oracle", "lfps",
             "lfps_gpu", "full_streaming"]
    modes = [m for m in modes if any(r["mode"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / (len(modes) + 1)
    for i, (ctx, batch) in enumerate(points):
        here = {r["mode"]: r for r in rows if (r["context"], r["batch"]) == (ctx, batch)}
        sdpa = next(iter(here.values()))["sdpa_ms_per_token_step"]
        ax.bar(i, sdpa, width, color="black", label="torch SDPA, all KV on GPU" if i == 0 else None)
        for j, m in enumerate(modes):
            if m not in here:
                continue
            r = here[m]
            x = i + (j + 1) * width
            ax.bar(x, r["ms_per_token_step"], width, color=f"C{j}", label=m if i == 0 else None)
            ax.text(x, r["ms_per_token_step"] * 1.08, f"{r['ratio']:.2g}x", ha="center", fontsize=6,
                    rotation=90)
    ax.set_xticks([i + 0.4 for i in range(len(points))])
    ax.set_xticklabels([f"{c // 1024}K, batch {b}" for c, b in points])
    ax.set_yscale("log")
    ax.set_ylabel("ms per token step (32 layers)")
    ax.set_title("kvferry Runtime end to end vs torch SDPA (H100, Llama-3.1-8B attention shape)\n"
                 "labels: kvferry time / SDPA time, same run")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(dst)


if __name__ == "__main__":
    main()
