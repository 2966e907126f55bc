#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Renders the benchmark JSON under bench/results/ into PNGs next to them:

  e2e.png              time per token step relative to torch SDPA with all KV on the GPU (same
                       run) vs context, per policy, from e2e.json
  quality_smollm2.png  perplexity gap to dense and attention-mass recall vs budget, per policy,
                       from quality_smollm2.json
  scale.png            time per token step of each (context, batch) point under the GPU memory
                       cap, per policy and selectors, with the baselines, from scale.json
  frontier.png         every policy's 128K decode time over SDPA's (real query) against its
                       perplexity gap to dense at 256 on KJV and the Jargon File, from frontier.json
  quality_gemma3_32k.png  Gemma 3's perplexity gap to dense vs budget (percent of the context),
                       per policy and parameters, one panel per text and context, from
                       quality_gemma3_32k.json

A plot whose JSON is absent is skipped with a message. Usage: plot.py [--results bench/results]
[--only e2e,quality,scale,frontier,gemma]
"""
import argparse
import glob
import json
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # the benchmark scripts call this at their end; plotting is optional there
    sys.exit("plot.py: matplotlib is not installed; no plots rendered")

E2E_MODES = ["dense_resident", "streaming_resident", "streaming", "quest", "sparcas", "oracle",
             "quest_bank", "sparcas_bank", "oracle_bank",
             "lfps", "lfps_gpu", "full_streaming"]


def save(fig, dst):
    """Lays out, writes and closes a figure; prints where it went."""
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)
    print(dst)


def plot_e2e(results):
    src = os.path.join(results, "e2e.json")
    if not os.path.exists(src):
        return print(f"plot.py: {src} absent; e2e plot skipped")
    d = json.load(open(src))
    rows = [r for r in d["rows"] if "skipped" not in r and r.get("name", "decode") == "decode"
            and r.get("ratio") and not r.get("async_cpu") == 0 and not r.get("engine_us")]
    # Each row's time relative to torch SDPA measured in the same run. One point per (mode,
    # context, batch, query): the rows with distinct keys at every position (unique_kv) where the
    # file has them, the median of a run's repetitions.
    def query(r):
        if r.get("query"):
            return r["query"]
        return f"moving (drift {r['query_drift']:g})" if r.get("query_drift") else "repeated (best case)"
    groups = {}
    for r in rows:
        k = (r["mode"], r["context"], r["batch"], query(r))
        groups.setdefault(k, []).append(r)
    pts = {}
    for k, rs in groups.items():
        uniq = [r for r in rs if r.get("unique_kv")] or rs
        uniq.sort(key=lambda r: r["ratio"])
        pts[k] = uniq[len(uniq) // 2]["ratio"]
    batches = sorted({k[2] for k in pts})
    fig, axes = plt.subplots(1, len(batches), figsize=(8.5 * len(batches), 5.5), squeeze=False)
    series = sorted({(k[0], k[3]) for k in pts}, key=lambda s: (s[1], s[0]))
    for ax, batch in zip(axes[0], batches):
        ax.axhline(1.0, color="k", lw=2, label="torch SDPA, all KV on the GPU")
        for j, (m, q) in enumerate(series):
            xy = sorted((k[1], v) for k, v in pts.items() if k[0] == m and k[3] == q and k[2] == batch)
            if not xy:
                continue
            best = q.startswith("repeated")
            label = f"{m}, {q} query" if not best else f"{m}, repeated query (best case)"
            color = plt.cm.tab20(j % 20)
            ax.plot([x for x, _ in xy], [y for _, y in xy], ":" if best else "-",
                    marker="os^D"[j % 4], color=color, label=label)
            for x, y in xy:
                ax.annotate(f"{y:.2g}x", (x, y), textcoords="offset points", xytext=(4, 2),
                            fontsize=6, color=color)
        ctxs = sorted({k[1] for k in pts if k[2] == batch})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ctxs)
        ax.set_xticklabels([f"{c // 1024}K" for c in ctxs])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("time per token step / SDPA's (same run)")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    gpus = sorted({(r.get("provenance") or {}).get("gpu", "?") for r in rows})
    fig.suptitle("kvferry Runtime end to end vs torch SDPA (Llama-3.1-8B attention shape, 32 layers, "
                 f"budget 2%); below 1: kvferry faster; {', '.join(gpus)}; solid: the real query, dotted: "
                 "the repeated query (the token bank's best case)", fontsize=9)
    save(fig, src[:-5] + ".png")


def plot_quality(results):
    src = os.path.join(results, "quality_smollm2.json")
    if not os.path.exists(src):
        return print(f"plot.py: {src} absent; quality plot skipped")
    d = json.load(open(src))
    rows = [r for r in d["rows"] if r.get("budget")]
    # A row's line: its policy, with its parameters when it has any (sparcas bits=4,d_b=32).
    def label(r):
        ps = r.get("params") or {}
        return r["policy"] + (" " + ",".join(f"{k}={v:g}" for k, v in ps.items()) if ps else "")
    policies = sorted({label(r) for r in rows if r.get("gap_pct") is not None})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for j, p in enumerate(policies):
        pts = sorted((r["budget"], r["gap_pct"]) for r in rows
                     if label(r) == p and r.get("gap_pct") is not None)
        a1.plot([b for b, _ in pts], [g for _, g in pts], "-o", color=f"C{j}", label=p)
        rec = sorted((r["budget"], r["trace_replay"]["mass_recall"]) for r in rows
                     if label(r) == p and r.get("trace_replay"))
        if rec:
            a2.plot([b for b, _ in rec], [m for _, m in rec], "-o", color=f"C{j}", label=p)
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("budget (tokens per KV head, resident ones included)")
    a1.set_ylabel("perplexity gap to dense (%)")
    a1.set_title("SmolLM2-135M on KJV, 8K context")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("budget")
    a2.set_ylabel("attention-mass recall")
    a2.set_title("real traces (SmolLM2, KJV 4K)")
    for a in (a1, a2):
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    save(fig, src[:-5] + ".png")


def plot_scale(results):
    src = os.path.join(results, "scale.json")
    if not os.path.exists(src):
        return print(f"plot.py: {src} absent; scale plot skipped")
    d = json.load(open(src))
    # One row per point and mode (the newest call of each, bench/reproduce.py scale).
    latest = {}
    for r in d["rows"]:
        if "skipped" not in r and r.get("ms_per_token_step"):
            latest[(r["mode"], r["context"], r["batch"])] = r
    rows = list(latest.values())
    points = sorted({(r["context"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(points), figsize=(3.2 * len(points) + 1, 4.5), squeeze=False)
    for ax, (ctx, batch) in zip(axes[0], points):
        here = sorted((r for r in rows if (r["context"], r["batch"]) == (ctx, batch)),
                      key=lambda r: r["ms_per_token_step"])
        names = [r["mode"] for r in here]
        ms = [r["ms_per_token_step"] for r in here]
        colors = ["0.6" if m in ("full_streaming", "dense_cpu") else f"C{i}" for i, m in enumerate(names)]
        ax.barh(range(len(here)), ms, color=colors)
        ax.set_yticks(range(len(here)))
        ax.set_yticklabels(names, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlim(0.3, 4000)
        sdpa = next((r["sdpa_uncapped_ms_per_token_step"] for r in here
                     if r.get("sdpa_uncapped_ms_per_token_step")), None)
        if sdpa:
            ax.axvline(sdpa, color="k", lw=1.5, ls="--", label="SDPA, all KV on the uncapped GPU")
        for i, r in enumerate(here):
            ratio = r.get("ratio_vs_sdpa_uncapped")
            ax.annotate(f"{r['ms_per_token_step']:.3g} ms" + (f" ({ratio:.2g}x)" if ratio else ""),
                        (r["ms_per_token_step"], i), textcoords="offset points", xytext=(3, -3),
                        fontsize=6)
        ax.set_title(f"{ctx // 1024}K x {batch}", fontsize=9)
        ax.set_xlabel("ms per token step (32 layers)", fontsize=8)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    axes[0][0].legend(fontsize=6, loc="lower right")
    gpus = " / ".join(sorted({str((r.get("provenance") or {}).get("gpu", "?")).replace("NVIDIA ", "")
                              for r in rows}))
    queries = " / ".join(sorted({str(r.get("query", "?")) for r in rows}))
    fig.suptitle(f"kvferry under an 8 GiB GPU memory cap ({gpus}, Llama-3.1-8B attention shape, "
                 f"2% budget, {queries} query); labels: kvferry / uncapped SDPA time measured in the "
                 "same call", fontsize=9)
    save(fig, src[:-5] + ".png")


def plot_frontier(results):
    src = os.path.join(results, "frontier.json")
    if not os.path.exists(src):
        return print(f"plot.py: {src} absent; frontier plot skipped")
    d = json.load(open(src))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    texts = (("kjv", "o", "KJV"), ("jargon", "s", "Jargon File"))
    for j, r in enumerate(d["rows"]):
        x = r.get("ratio_vs_sdpa_128k_b1")
        if x is None:
            continue
        color = "k" if r["policy"] == "oracle" else plt.cm.tab10(j % 10)
        ys = []
        for t, marker, _ in texts:
            y = r.get(f"gap_pct_{t}")
            if y is not None:
                ax.scatter([x], [max(y, 0.1)], marker=marker, color=color, s=60 if r["policy"] == "oracle" else 36)
                ys.append(max(y, 0.1))
        if ys:
            ax.plot([x, x], [min(ys), max(ys)], color=color, lw=1)
            ax.annotate(r["policy"], (x, max(ys)), textcoords="offset points", xytext=(4, 3), fontsize=8,
                        color=color)
    for t, marker, name in texts:
        ax.scatter([], [], marker=marker, color="gray", label=name)
    ax.axvline(1.0, color="k", lw=1.5, ls="--", label="torch SDPA, all KV on the GPU")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("time per token step at 128K x 1 / SDPA's (same run), real query")
    ax.set_ylabel("perplexity gap to dense at 256 of 8K (%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Fast and faithful: lower left is better (SmolLM2-135M quality, Llama-3.1-8B-shaped speed)",
                 fontsize=9)
    save(fig, src[:-5] + ".png")


def plot_gemma(results):
    src = os.path.join(results, "quality_gemma3_32k.json")
    if not os.path.exists(src):
        return print(f"plot.py: {src} absent; Gemma plot skipped")
    d = json.load(open(src))
    rows = [r for r in d["rows"] if r.get("budget") and r.get("gap_pct") is not None]

    def label(r):
        ps = r.get("params") or {}
        return r["policy"] + (" " + ",".join(f"{k}={v:g}" for k, v in ps.items()) if ps else "")
    panels = sorted({(r["context"], r["text"]) for r in rows}, key=lambda p: (p[0], "jargon" in p[1]))
    lanes = sorted({label(r) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.5), squeeze=False)
    for a, (ctx, text) in zip(axes[0], panels):
        for j, ln in enumerate(lanes):
            pts = sorted((r.get("budget_pct") or 100 * r["budget"] / ctx, r["gap_pct"]) for r in rows
                         if label(r) == ln and r["context"] == ctx and r["text"] == text)
            style = "-o" if ln.split()[0] in ("oracle", "lfps", "sparcas") else "--o"
            a.plot([b for b, _ in pts], [max(g, 1e-2) for _, g in pts], style, color=f"C{j % 10}",
                   label=ln, markersize=4)
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        pcts = sorted({r.get("budget_pct") or round(100 * r["budget"] / r["context"]) for r in rows})
        a.set_xticks(pcts, [f"{p:g}%" for p in pcts])
        a.set_xlabel("budget (of the context, global layers)")
        a.set_title(f"{os.path.basename(text)[:-4]}, {ctx // 1024}K")
        a.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("perplexity gap to dense (%)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Gemma 3 270M, last 1024 tokens scored (host backend)")
    save(fig, src[:-5] + ".png")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--only", default="e2e,quality,scale,frontier,gemma")
    a = ap.parse_args()
    plots = {"e2e": plot_e2e, "quality": plot_quality, "scale": plot_scale, "frontier": plot_frontier,
             "gemma": plot_gemma}
    for name in a.only.split(","):
        if name not in plots:
            sys.exit(f"plot.py: unknown plot '{name}' (known: {', '.join(plots)})")
        plots[name](a.results)


if __name__ == "__main__":
    main()
