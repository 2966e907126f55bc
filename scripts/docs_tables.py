#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Writes the measured tables of README.md and docs/*.md from bench/results/*.json.

A table lives between two markers in a markdown file:

    <!-- table:NAME -->
    ...generated, do not edit...
    <!-- /table:NAME -->

`python3 scripts/docs_tables.py` rewrites every marked table from the results files;
`python3 scripts/docs_tables.py --check` rewrites nothing and exits 1, printing the diff, when a
marked table differs from what the results produce (CI runs it through scripts/check_tree.py);
`--list` prints the table names. Standard library only (no numpy, no torch, no network).
"""
import argparse
import difflib
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "bench", "results")
MARK = re.compile(r"(<!-- table:([a-z0-9_-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)

# What the "which policy" table says beside the numbers: where the policy selects and attends, and
# when to pick it. Words, not figures: every figure comes from bench/results.
POLICIES = [
    # name, e2e mode at 128K, where it runs, when to pick it
    ("dense", "dense_resident", "GPU (every row resident)",
     "the reference: the context fits in GPU memory and quality may not move"),
    ("streaming", "streaming_resident", "GPU (sinks + window only)",
     "the fastest and smallest, when only recent tokens matter; loses long-range recall"),
    ("oracle", "oracle_bank", "GPU, every key scored over PCIe",
     "a quality ceiling for experiments (exact top-k); too slow to serve"),
    ("quest", "quest_bank", "GPU (page bounds in HBM) + token bank",
     "faster than SDPA at long contexts when a quality gap is acceptable; on some text it loses as much as streaming"),
    ("sparcas", "sparcas_bank", "GPU (4-bit compact keys in HBM) + token bank",
     "near-oracle quality selected on the GPU, on SmolLM2 and on models with QK-norm (Gemma 3: its channel "
     "smoothing, the default), but its scan of every compact key makes a moving query's step slower than "
     "SDPA's (speed rows at `smooth=0`)"),
    ("hip", "hip_bank", "GPU (cached hierarchical masks, rebuilt when the query turns) + token bank",
     "fast, and ahead of streaming on every text tried at every budget but the Jargon File's 2048, which `align=0` (the paper's even first nodes; its GPU step not yet measured) closes too (policies.md); "
     "at 256 of 8K still several times the oracle's gap (the recall guard, host selection, closes more)"),
    ("kvpop", "kvpop_bank", "GPU (learned eviction slots) + token bank",
     "the fastest sparse step; quality depends on the trained scorer (`scorer=2`: untrained)"),
    ("lfps", "lfps", "CPU selects and attends the offloaded picks, GPU the resident rows",
     "oracle quality on both texts when GPU memory is tight and time matters less (the CPU selects and attends); "
     "on head dims above 64 with `scan` at a quarter of them (Gemma 3: `scan=64`)"),
]


def load(name):
    path = os.path.join(RES, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def fmt(x, nd=3):
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}" if abs(x) >= 10000 else str(x)
    if isinstance(x, float):
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.{nd}g}"
    return str(x)


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def gpu_short(r):
    g = (r.get("provenance") or {}).get("gpu", "")
    for name in ("H200", "H100"):
        if name in g:
            return name
    return g or "—"


def e2e_decode():
    d = load("e2e.json")
    return [r for r in d["rows"] if r.get("name") == "decode" and "skipped" not in r] if d else []


REPEATED = "repeated (best case)"


def query_of(r):
    """The row's decode query: kvferry-e2e's own label, or (rows from before it wrote one) the
    drift's."""
    if r.get("query"):
        return r["query"]
    drift = float(r.get("query_drift", 0) or 0)
    return f"moving (drift {drift:g})" if drift else REPEATED


def e2e_pick(mode, context, batch, query=REPEATED):
    """The row of (mode, context, batch, query) the tables quote: the default configuration (the
    runtime thread on, no emulated engine work), keys unique at every position where such a row
    exists, the median of a run's repetitions."""
    rs = [r for r in e2e_decode() if r["mode"] == mode and r["context"] == context
          and r["batch"] == batch and query_of(r) == query
          and r.get("async_cpu", 1) != 0 and not r.get("engine_us")]
    if not rs:
        return None
    rs = [r for r in rs if r.get("unique_kv")] or rs
    rs.sort(key=lambda r: (r.get("ratio") is None, r.get("ms_per_token_step") or 0))
    timed = [r for r in rs if r.get("ratio") is not None] or rs
    return timed[len(timed) // 2]


def quality_rows():
    d = load("quality_smollm2.json")
    return d["rows"] if d else []


def quality_pick(policy, budget, params=None):
    for r in quality_rows():
        if r["policy"] == policy and r.get("budget") == budget and r.get("gap_pct") is not None:
            if params is None or (r.get("params") or {}) == params:
                return r
    return None




def frontier_pick(policy):
    """The policy's row of frontier.json (its perplexity gaps on both texts at 256 of 8K)."""
    d = load("frontier.json")
    return next((r for r in d["rows"] if r["policy"] == policy and r.get("gap_pct_kjv") is not None
                 and r.get("gap_pct_jargon") is not None), None) if d else None


# HiP's defaults changed at 7f57871 (a mask rebuilt when the query turns, used in its own step).
# Rows written since carry the defaults they ran with ("hip_defaults", bench/reproduce.py); a hip
# row without it ran the paper's cadence.
HIP_DEFAULTS = {"r_m": 8, "drift": 0.7, "lag": 0}
HIP_DEFAULTS_BEFORE = {"r_m": 8, "drift": 0, "lag": 1}


def hip_row_defaults(r):
    """The HiP defaults a row ran with."""
    return r.get("hip_defaults") or HIP_DEFAULTS_BEFORE


def hip_params_label(r, ps=None):
    """A HiP row's parameters (\p ps, else its own) as a table cell: "defaults" for today's, the old
    defaults spelled out (and marked) for a row that ran them (hip_row_defaults)."""
    ps = (r.get("params") if ps is None else ps) or {}
    d = hip_row_defaults(r)
    own = ", ".join(f"{k}={v:g}" for k, v in ps.items())
    if d != HIP_DEFAULTS:
        merged = {**d, **ps}
        if all(merged.get(k) == v for k, v in HIP_DEFAULTS.items()):
            return "defaults"
        then = ", ".join(f"{k}={v:g}" for k, v in d.items() if k not in ps and HIP_DEFAULTS.get(k) != v)
        if not ps:
            return f"{then} (the defaults then)"
        return f"{own} ({then} then)" if then else own
    return own or "defaults"


def params_cell(policy, ps, r):
    """A lane's parameters \p ps as a table cell; HiP's by hip_params_label (\p r: the row that
    carries the provenance)."""
    if policy.split("@")[0].split("_")[0] == "hip" and r is not None:
        return hip_params_label(r, ps)
    cell = ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in (ps or {}).items()) \
        or "defaults"
    # KVpop's trained scorer: rows before kvpop_decay_smollm2 ran an earlier scorer file (two texts, the
    # paper's decay); rows of that run carry "decay".
    if (policy.split("@")[0].split("_")[0] == "kvpop" and r is not None and "decay" not in r
            and (ps or {}).get("scorer") not in (0, 2) and kvpop_decay_rows()):
        cell += " (the scorer file then: two texts, the paper's decay)"
    return cell


def hip_default_rows():
    """HiP's rows at today's defaults (hip_params_label): its speed, hip_speed.json's row by batch;
    its SmolLM2 rows at 256, hip_drift_smollm2.json's by text, with that run's dense (passkey)."""
    is_default = lambda r: r["policy"] == "hip" and hip_params_label(r) == "defaults"
    sp, hd = load("hip_speed.json"), load("hip_drift_smollm2.json")
    speed = {r["batch"]: r for r in sp["rows"] if is_default({"policy": "hip", **r})} if sp else None
    quality = None
    if hd:
        quality = {r["text"]: r for r in hd["rows"] if is_default(r) and r.get("budget") == 256}
        quality["dense"] = next((r for r in hd["rows"] if r["policy"] == "dense" and r.get("passkey")), None)
    return speed, quality


def kvpop_decay_rows():
    """KVpop's SmolLM2 rows at 256 with the committed scorer file (its decays chosen by decoding),
    kvpop_decay_smollm2.json's by text, with that run's dense (passkey); None before that run."""
    d = load("kvpop_decay_smollm2.json")
    if not d:
        return None
    q = {r["text"]: r for r in d["rows"] if r["label"] == "kvpop@256"}
    q["dense"] = next((r for r in d["rows"] if r["policy"] == "dense" and r.get("passkey")), None)
    return q


def passkey_whenever_dense(row, dense):
    """Whether \p row's passkey prompts include every one \p dense found (their by_prompt lists)."""
    got = {(p["length"], p["depth"]) for p in row["passkey"]["by_prompt"] if p["found"]}
    return all((p["length"], p["depth"]) in got for p in dense["passkey"]["by_prompt"] if p["found"])


def t_policy():
    head = ["policy", "where it runs", "128K x 1: ms / step (GPU)", "vs SDPA, 128K x 1",
            "vs SDPA, 128K x 4", "vs SDPA, 128K x 1, repeated query (best case)",
            "SmolLM2, 256 of 8K: gap to dense (KJV, Jargon)", "gap / oracle's gap (KJV, Jargon)",
            "passkey whenever dense finds it",
            "Gemma 3, 32K, 2%: gap / oracle's (KJV, Jargon)", "pick it when"]
    rows = []
    ratio = lambda r: f"{r['ratio']:.3f}x" if r and r.get("ratio") else None
    for name, mode, where, when in POLICIES:
        # Query-independent rows (nothing selected) ran with the repeated query only.
        fixed = mode in ("dense_resident", "streaming_resident")
        real = e2e_pick(mode, 131072, 1, REPEATED if fixed else "real")
        real4 = e2e_pick(mode, 131072, 4, REPEATED if fixed else "real")
        rep = e2e_pick(mode, 131072, 1)
        q = quality_pick(name, 256, {}) if name != "dense" else None
        ms = f"{fmt(real['ms_per_token_step'])} ({gpu_short(real)})" if real else None
        f = frontier_pick(name)
        gap = (f"+{f['gap_pct_kjv']:.1f}%, +{f['gap_pct_jargon']:.1f}%" if f else
               "0 (reference)" if name == "dense" else None)
        over = (f"{f['gap_over_oracle_gap_kjv']:.2f}x, {f['gap_over_oracle_gap_jargon']:.2f}x"
                if f and f.get("gap_over_oracle_gap_kjv") and f.get("gap_over_oracle_gap_jargon") else None)
        pk = q.get("passkey") if q else None
        pk = ("yes" if pk.get("found_whenever_dense_does") else "no") if pk else None
        gemma = gemma_cell(name)
        if name == "hip":  # its default since drift: the runs that name it apart (hip_default_rows)
            hs, hq = hip_default_rows()
            real, real4, rep = (hs or {}).get(1), (hs or {}).get(4), None
            ms = f"{fmt(real['ms_per_token_step'])} ({gpu_short(real)})" if real else None
            kjv, jar = (hq or {}).get("data/kjv.txt"), (hq or {}).get("data/jargon.txt")
            gap = f"+{kjv['gap_pct']:.1f}%, +{jar['gap_pct']:.1f}%" if kjv and jar else None
            over = (f"{kjv['gap_over_oracle_gap']:.2f}x, {jar['gap_over_oracle_gap']:.2f}x" if kjv and jar else None)
            pk = (("yes" if passkey_whenever_dense(kjv, hq["dense"]) else "no")
                  if kjv and kjv.get("passkey") and hq.get("dense") else None)
            gemma = f"— (`drift=0, lag=1`: {gemma})" if gemma else None
        if name == "kvpop":  # its scorer file since the decays chosen by decoding (kvpop_decay_rows)
            kq = kvpop_decay_rows()
            if kq:
                kjv, jar = kq.get("data/kjv.txt"), kq.get("data/jargon.txt")
                gap = f"+{kjv['gap_pct']:.1f}%, +{jar['gap_pct']:.1f}%" if kjv and jar else None
                over = (f"{kjv['gap_over_oracle_gap']:.2f}x, {jar['gap_over_oracle_gap']:.2f}x" if kjv and jar else None)
                pk = (("yes" if passkey_whenever_dense(kjv, kq["dense"]) else "no")
                      if kjv and kjv.get("passkey") and kq.get("dense") else None)
        mname = f"`{name}`" + (f" (`{mode}`)" if mode != name else "")
        rows.append([mname, where, ms, ratio(real), ratio(real4), ratio(rep), gap, over, pk, gemma, when])
    return table(head, rows) + (
        "\nSpeed: `kvferry-e2e`, 32 layers of the Llama-3.1-8B attention shape, 128K context, budget 2% "
        "(streaming: sinks + window of 1024), time relative to torch SDPA with all KV on the GPU in the same "
        "run (below 1x: faster than SDPA), with the query that moves as SmolLM2's does "
        "(`--query real`: docs/benchmarks.md, section The decode query); the "
        "repeated query is the token bank's best case; — : no such row in `bench/results/e2e.json`. "
        "Quality: SmolLM2-135M, 8K windows of KJV and the Jargon File, last 1024 scored, host "
        "backend (`bench/results/frontier.json`; kvpop with its trained scorer, while the speed "
        "rows use a random scorer of the same size; sparcas with its channel smoothing, while its speed rows "
        "ran at `smooth=0`, the default then); passkey: KJV, 2K/4K x 3 depths and 8K "
        "(`bench/results/quality_smollm2.json`). Gemma 3: 270M, 32K windows of KJV and the Jargon File, "
        "last 1024 scored, 2% of the context on its global layers, host backend "
        "(`bench/results/quality_gemma3_32k.json`; kvpop without a Gemma scorer). " + (
            "kvpop: its SmolLM2 gaps and passkey are `bench/results/kvpop_decay_smollm2.json`'s (the committed "
            "scorer file, its decays chosen by decoding; that run's oracle and dense; passkey at 2K/4K/8K x 3 "
            "depths). " if kvpop_decay_rows() else "") + "hip: its default rebuilds a "
        "mask when the query turns (`drift=0.7, lag=0`); its speed is `bench/results/hip_speed.json`'s default "
        "(no repeated-query row), its SmolLM2 gaps and passkey `bench/results/hip_drift_smollm2.json`'s default "
        "lane (that run's oracle and dense; passkey at 2K/4K/8K x 3 depths), its Gemma 3 figure the paper's "
        "cadence (every 8 steps, a step late: the default then).\n")


# A policy's parameters as kvferry's defaults set them, for results that run a policy as several
# lanes of explicit parameters (quality_gemma3_32k: sparcas with smooth=0 and smooth=1).
DEFAULT_PARAMS = {"sparcas": {"smooth": 1.0}}


def is_default_lane(r):
    """Whether a row's lane is its policy with kvferry's defaults."""
    ps = r.get("params") or {}
    want = DEFAULT_PARAMS.get(r["policy"], {})
    return all(ps.get(k, v) == v for k, v in want.items()) and all(k in want for k in ps)


def gemma_cell(policy):
    """Gemma 3 at 32K and 2%: gap over the oracle's gap, KJV then Jargon (quality_gemma3_32k.json), of
    the policy with its defaults, then of each other parameter set it ran with, in brackets."""
    d = load("quality_gemma3_32k.json")
    if not d:
        return None
    if policy == "dense":
        return "reference"
    lanes = {}
    for r in d["rows"]:
        if r["policy"] == policy and r["context"] == 32768 and r.get("budget_pct", 2) == 2:
            ps = r.get("params") or {}
            key = "" if is_default_lane(r) else ", ".join(f"{k}={v:g}" for k, v in ps.items())
            lanes.setdefault(key, {})[r["text"]] = r.get("gap_over_oracle_gap")

    def pair(by):
        x = [by.get(t) for t in ("data/kjv.txt", "data/jargon.txt")]
        return None if None in x else ", ".join(f"{v:.2f}x" for v in x)
    if pair(lanes.get("", {})) is None:
        return None
    extra = "".join(f" (`{k}`: {pair(v)})" for k, v in sorted(lanes.items()) if k and pair(v))
    return pair(lanes[""]) + extra


def t_e2e():
    head = ["mode", "context", "batch", "query", "keys unique", "ms / step", "SDPA ms / step",
            "ratio", "bank hit rate", "GPU"]
    rows = []
    for r in sorted(e2e_decode(), key=lambda r: (r["batch"], r["context"], r["mode"],
                                                 query_of(r), r.get("variant") or "")):
        if r.get("async_cpu") == 0 or r.get("engine_us"):
            continue
        rows.append([f"`{r['mode']}`", f"{r['context'] // 1024}K", r["batch"], query_of(r),
                     "yes" if r.get("unique_kv") else "no",
                     r.get("ms_per_token_step"), r.get("sdpa_ms_per_token_step"),
                     f"{r['ratio']:.3f}x" if r.get("ratio") else None,
                     r["bank_hit_rate"] if (r.get("bank_hit_rate") or -1) >= 0 else None, gpu_short(r)])
    return table(head, rows)


def t_query():
    d = load("query_calibration.json")
    if not d:
        return ""
    tr, real = d["traces"], d["real"]
    lags = sorted(tr["mean"], key=int)
    head = ["steps apart", "KJV trace", "Jargon trace", "traces' mean",
            f"`--query real` at 32K (drift {real['drift']:g}, rho {real['rho']:g})", "at 128K"]
    rows = [[l, tr["per_text"]["kjv"][l], tr["per_text"]["jargon"][l], tr["mean"][l],
             real["overlap_32k"][l], real["overlap_128k"][l]] for l in lags]
    bank = {(r["text"], r["policy"]): r["bank_hit_rate"] for r in d["rows"]}
    pols = sorted({r["policy"] for r in d["rows"]}, key=lambda p: ["oracle", "sparcas", "quest", "hip"].index(p)
                  if p in ("oracle", "sparcas", "quest", "hip") else 9)
    return table(head, rows) + "\n" + table(
        ["token bank hit rate on the traces"] + [f"`{p}`" for p in pols],
        [[t] + [bank.get((t, p)) for p in pols] for t in ("kjv", "jargon")])


def t_prefill():
    d = load("e2e.json")
    head = ["mode", "context", "chunk", "order", "ms / layer", "SDPA flash ms / layer", "ratio",
            "TFLOP/s", "GPU"]
    rows = []
    for r in sorted((r for r in d["rows"] if r.get("name") == "prefill"),
                    key=lambda r: (r["mode"], r.get("order") or "", r["context"], r["chunk"])):
        rows.append([f"`{r['mode']}`", f"{r['context'] // 1024}K", r["chunk"], r.get("order"),
                     r.get("ms_per_layer"), r.get("sdpa_flash_ms_per_layer"),
                     f"{r['ratio']:.3f}x" if r.get("ratio") else None, r.get("tflops"), gpu_short(r)])
    return table(head, rows)


def t_scale():
    d = load("scale.json")
    head = ["point", "mode", "ms / step", "tokens/s", "x full streaming", "x dense CPU",
            "vs SDPA uncapped", "GPU"]
    rows = []
    for r in sorted(d["rows"], key=lambda r: (r["context"], r["batch"], r.get("ms_per_token_step") or 1e9)):
        pt = f"{r['context'] // 1024}K x {r['batch']}"
        if "skipped" in r:
            rows.append([pt, f"`{r['mode']}`", "refused by the cap", None, None, None, None, gpu_short(r)])
            continue
        rows.append([pt, f"`{r['mode']}`", r["ms_per_token_step"], r.get("tokens_per_s"),
                     r.get("speedup_vs_full_streaming"), r.get("speedup_vs_dense_cpu"),
                     f"{r['ratio_vs_sdpa_uncapped']:.3f}x" if r.get("ratio_vs_sdpa_uncapped") else None,
                     gpu_short(r)])
    return table(head, rows)


def t_quality():
    head = ["policy", "parameters", "budget", "perplexity", "gap to dense", "gap / oracle's",
            "attention-mass recall (KJV 4K trace)", "passkey whenever dense finds it"]
    rows = []
    for r in sorted(quality_rows(), key=lambda r: (r.get("budget") or 0, r.get("gap_pct") or 0)):
        if r.get("perplexity") is None:
            continue
        ps = r.get("params") or {}
        tr = r.get("trace_replay") or {}
        pk = r.get("passkey")
        rows.append([f"`{r['policy']}`", params_cell(r["policy"], ps, r),
                     r.get("budget") or "all", r["perplexity"],
                     f"+{r['gap_pct']:.2f}%" if r.get("gap_pct") else "0",
                     f"{r['gap_over_oracle_gap']:.2f}x" if r.get("gap_over_oracle_gap") else None,
                     tr.get("mass_recall"),
                     ("yes" if pk.get("found_whenever_dense_does", pk.get("missed_where_dense_found") == 0)
                      else "no") if pk else None])
    return table(head, rows)


def t_kernels():
    d = load("torch_sdpa.json")
    head = ["batch", "context", "kvferry us", "kvferry HBM GB/s", "torch SDPA us", "speed vs SDPA"]
    rows = [[r["batch"], f"{r['ctx'] // 1024}K", r["ours_us"], r["ours_hbm_gbps"], r["sdpa_us"],
             f"{r['speed_ratio_ours_over_sdpa']:.2f}x"] for r in d["rows"]]
    return table(head, rows)


def t_cpu():
    d = load("cpu_attention.json")
    head = ["threads", "sparse attention GB/s", "fraction of the DRAM limit"]
    rows = [[r["threads"], r["gbs"], f"{r['frac_of_dram_limit']:.2f}"] for r in d["sparse_pool"]]
    return table(head, rows) + f"\nDRAM limit: {d['dram_limit_gbs']} GB/s; kernels: {d['cpu_isa']}.\n"


def t_prefill_host():
    head = ["machine", "tokens", "chunk", "tokens/s before", "tokens/s", "speedup", "GFLOP/s"]
    rows = []
    for f in ("prefill_host_16core.json", "prefill_host_2core.json"):
        d = load(f)
        for r in d["rows"]:
            rows.append([f"{d['cpu']}, {d['hardware_threads']} threads", r["tokens"], r["chunk"],
                         r["before_tokens_per_s"], r["after_tokens_per_s"], f"{r['speedup']:.2f}x",
                         r["gflops"]])
    return table(head, rows)


def t_transfer():
    d = load("gpu_attention.json")
    head = ["row bytes", "H2D copy GB/s", "zero-copy gather GB/s", "batched copy GB/s"]
    rows = []
    for k in sorted((k for k in d if k.startswith("probe_row")), key=lambda k: int(k[9:])):
        p = d[k]
        rows.append([p["gather_row_bytes"], p["h2d_gbps"], p["zero_copy_gather_gbps"], p["batched_copy_gbps"]])
    s = load("transfer_span.json")
    head2 = ["span of host memory (GiB)", "rows", "zero-copy gather GB/s", "contiguous H2D GB/s"]
    rows2 = [[r["span_bytes"] / 2**30, r["rows"], r["zero_copy_gbps"], r["h2d_contig_gbps"]]
             for r in sorted(s["runs"], key=lambda r: (r["rows"], r["span_bytes"]))]
    return table(head, rows) + "\n" + table(head2, rows2)


def t_hip_replay():
    """bench/results/hip_kvpop_replay_smollm2.json: each lane's mass, recall and error, both texts,
    and the mass in the layers where HiP's tree loses it (3-10)."""
    d = load("hip_kvpop_replay_smollm2.json")
    if not d:
        return "(bench/results/hip_kvpop_replay_smollm2.json not yet generated)\n"
    texts = {os.path.basename(r["text"].split()[0]).replace(".txt", "").upper().replace("JARGON", "Jargon"):
             {l["label"]: l for l in r["lanes"]} for r in d["rows"]}
    head = ["lane", "budget", "parameters"]
    for t in texts:
        head += [f"{t}: mass kept", f"{t}: recall of exact top-k", f"{t}: output error", f"{t}: mass, layers 3-10"]
    rows = []
    first = next(iter(texts.values()))
    for lab, l in first.items():
        row = [f"`{lab}`", l["budget"], params_cell(l.get("policy", lab), l["params"], d["rows"][0])]
        for t, lanes in texts.items():
            x = lanes.get(lab)
            if x is None:
                row += [None] * 4
                continue
            mid = [p["all"]["mass"] for p in x["per_layer"] if 3 <= p["layer"] <= 10]
            row += [x["all"]["mass"], x["all"]["recall"], x["all"]["rel_err"], sum(mid) / len(mid) if mid else None]
        rows.append(row)
    return table(head, rows)


def t_hip_quality():
    """bench/results/hip_quality_smollm2.json: perplexity gap per text and lane, passkey on KJV."""
    d = load("hip_quality_smollm2.json")
    if not d:
        return "(bench/results/hip_quality_smollm2.json not yet generated)\n"
    by = {}
    for r in d["rows"]:
        by.setdefault(r["label"], {})[r["text"]] = r
    texts = sorted({r["text"] for r in d["rows"]}, key=lambda t: ("kjv" not in t, t))
    head = ["lane", "budget", "parameters"] + [f"{os.path.basename(t).replace('.txt', '').upper().replace('JARGON', 'Jargon')}: "
                                               "gap to dense (/ oracle's)" for t in texts] + \
           ["passkey (KJV, 2K/4K/8K x 3 depths)", "head-steps ranked afresh (KJV, Jargon)"]
    rows = []
    def budget(lab, per):
        return None if lab == "dense" else next(iter(per.values())).get("budget")
    for lab, per in sorted(by.items(), key=lambda kv: (budget(*kv) or 0, kv[0])):
        r0 = next(iter(per.values()))
        cells = [f"`{lab}`", budget(lab, per) or "all",
                 params_cell(r0["policy"], r0.get("params"), r0)]
        for t in texts:
            r = per.get(t)
            if not r or r.get("gap_pct") is None:
                cells.append("0" if r else None)
                continue
            o = f" ({r['gap_over_oracle_gap']:.2f}x)" if r.get("gap_over_oracle_gap") else ""
            cells.append(f"+{r['gap_pct']:.2f}%{o}")
        pk = next((r.get("passkey") for r in per.values() if r.get("passkey")), None)
        cells.append(f"{pk['found']}/{pk['trials']}" if pk else None)
        shares = [per[t].get("ranked_share") for t in texts if t in per]
        cells.append(", ".join("—" if x is None else f"{x:.0%}" for x in shares) if any(x is not None for x in shares) else None)
        rows.append(cells)
    return table(head, rows)


def texts_of(rows):
    """The rows' texts in the order they first appear."""
    return list(dict.fromkeys(r["text"] for r in rows))


def text_name(path):
    """A quality text's short name in a table (KJV, Jargon, GPL-3), else its file name."""
    return {"kjv": "KJV", "jargon": "Jargon", "gpl-3": "GPL-3"}.get(
        os.path.basename(path).replace(".txt", "").lower(), os.path.basename(path))


def hip_lane_table(name_json, builds):
    """A HiP lanes file (hip_drift_smollm2): perplexity gap to dense per lane
    (policy and parameters), text and budget; with \p builds the share of the mask layers'
    head-steps that built a mask (range over the texts and budgets); passkey at 256."""
    d = load(name_json)
    if not d:
        return f"(bench/results/{name_json} not yet generated)\n"
    lane = lambda r: (r["policy"], tuple(sorted((r.get("params") or {}).items())))
    name = text_name
    cols = []
    for r in d["rows"]:
        if r["policy"] != "dense" and (r["text"], r["budget"]) not in cols:
            cols.append((r["text"], r["budget"]))
    cols.sort(key=lambda c: ("kjv" not in c[0], "jargon" not in c[0], c[0], c[1]))
    cells, order, pk, made = {}, [], {}, {}
    for r in d["rows"]:
        if r.get("passkey"):
            pk[lane(r)] = r["passkey"]
        if r["policy"] == "dense":
            continue
        if lane(r) not in order:
            order.append(lane(r))
        cells[(lane(r), r["text"], r["budget"])] = r.get("gap_pct")
        if r.get("mask_builds") is not None:
            made.setdefault(lane(r), []).append(r["mask_builds"])
    # streaming, the oracle, then HiP from the paper's cadence (r_m 8, no drift) to the freshest
    eff = {ln: {**hip_row_defaults(r), **dict(ln[1])} for r in d["rows"] for ln in [lane(r)]}
    order.sort(key=lambda ln: (ln[0] != "streaming", ln[0] != "oracle", -eff[ln].get("r_m", 8),
                               eff[ln].get("drift", 0)))
    label = {lane(r): hip_params_label(r) if r["policy"] == "hip" else
             (", ".join(f"{k}={v}" for k, v in lane(r)[1]) or "defaults") for r in d["rows"]}
    head = ["lane", "parameters"] + [f"{name(t)} @{b}" for t, b in cols] + \
           (["mask builds"] if builds else []) + ["passkey @256 (KJV, 2K/4K/8K x 3 depths)"]
    share = lambda bs: "—" if not bs else (f"{min(bs):.0%}" if round(min(bs), 2) == round(max(bs), 2)
                                          else f"{min(bs):.0%}-{max(bs):.0%}")
    dense = next((r for r in d["rows"] if r["policy"] == "dense"), None)
    rows = [["`dense`", "all tokens"] + ["+0.00%"] * len(cols) + (["—"] if builds else []) +
            [f"{pk[lane(dense)]['found']}/{pk[lane(dense)]['trials']}" if dense and lane(dense) in pk else None]]
    for ln in order:
        row = [f"`{ln[0]}`", label[ln]]
        for t, b in cols:
            g = cells.get((ln, t, b))
            row.append(None if g is None else f"+{g:.2f}%")
        if builds:
            row.append(share(made.get(ln)))
        row.append(f"{pk[ln]['found']}/{pk[ln]['trials']}" if ln in pk else None)
        rows.append(row)
    p = d["rows"][0].get("provenance", {})
    return table(head, rows) + f"\n(perplexity gap to dense; {p.get('commit', '')}, {p.get('cpu', '')})\n"


def t_hip_drift():
    """bench/results/hip_drift_smollm2.json (hip_lane_table, with each lane's mask builds)."""
    return hip_lane_table("hip_drift_smollm2.json", builds=True)


def t_knorm():
    """bench/results/knorm_smollm2.json: knorm's perplexity gap next to streaming and the oracle."""
    d = load("knorm_smollm2.json")
    if not d:
        return "(bench/results/knorm_smollm2.json not yet generated)\n"
    texts = texts_of(d["rows"])
    cell = {(r["policy"], r["text"]): r for r in d["rows"]}
    rows = []
    for pol in ("streaming", "oracle", "knorm"):
        row = [f"`{pol}`"]
        for t in texts:
            r = cell.get((pol, t))
            row.append(None if r is None else f"+{r['gap_pct']:.1f}% ({r['gap_over_oracle_gap']:.1f}x the oracle's)")
        rows.append(row)
    head = ["policy @256"] + [f"{text_name(t)} ({cell[('dense', t)]['context'] // 1024}K)" for t in texts]
    p = d.get("provenance", {})
    return table(head, rows) + f"\n(perplexity gap to dense; {p.get('commit', '')}, {p.get('cpu', '')})\n"


def t_kvpop_decay():
    """bench/results/kvpop_decay_smollm2.json: perplexity gap to dense per lane (streaming, the oracle,
    KVpop with its decays chosen by decoding, the same scorer at the paper's decay), text and
    budget; passkey at 256; then the decays the search chose per layer."""
    d = load("kvpop_decay_smollm2.json")
    if not d:
        return "(bench/results/kvpop_decay_smollm2.json not yet generated)\n"
    name = text_name
    cols, cells, pk, order = [], {}, {}, []
    for r in d["rows"]:
        ln = r["label"].split("@")[0]
        if r.get("passkey"):
            pk[ln] = r["passkey"]
        if ln == "dense":
            continue
        if (r["text"], r["budget"]) not in cols:
            cols.append((r["text"], r["budget"]))
        if ln not in order:
            order.append(ln)
        cells[(ln, r["text"], r["budget"])] = r.get("gap_pct")
    what = {"streaming": "`streaming`", "oracle": "`oracle`", "kvpop": "`kvpop`, decays chosen by decoding",
            "kvpop_paper": "`kvpop`, the paper's decay"}
    ctx = {r["text"]: r["context"] for r in d["rows"]}
    head = ["text, budget"] + [what.get(ln, f"`{ln}`") for ln in order]
    rows = []
    for t, b in cols:
        rows.append([f"{name(t)} ({ctx[t] // 1024}K), {b}"] +
                    [None if cells.get((ln, t, b)) is None else f"+{cells[(ln, t, b)]:.2f}%" for ln in order])
    rows.append([f"passkey @256 (KJV, 2K/4K/8K x 3 depths; dense {pk['dense']['found']}/{pk['dense']['trials']})"
                 if "dense" in pk else "passkey @256"] +
                [f"{pk[ln]['found']}/{pk[ln]['trials']}" if ln in pk else None for ln in order])
    p = d["rows"][0].get("provenance", {})
    texts = list(d["search"]["evaluations"][0]["perplexity"])
    def spans(dec):  # "layers a-b: gamma g; ..." over a list of per-layer decays
        out, start = [], 0
        for i in range(1, len(dec) + 1):
            if i == len(dec) or dec[i] != dec[start]:
                out.append(f"layers {start}-{i - 1}: " + ("recency" if dec[start] <= 0.01 else f"gamma {dec[start]:g}"))
                start = i
        return out
    srows = [[e["tag"] if not e["tag"].startswith("best") else
              e["tag"].replace("best", "the best", 1) + " (" + "; ".join(x for x in spans(e["decays"]) if "recency" not in x) + ")"] +
             [f"{e['perplexity'][t]:.2f}" for t in texts] + [f"{math.exp(e['objective']):.2f}"]
             for e in d["search"]["evaluations"]]
    shead = ["search: decays tried (recency elsewhere)"] + \
            [f"{name(t.rsplit(':', 1)[0])} from line {t.rsplit(':', 1)[1]}" for t in texts] + ["geometric mean"]
    return (table(head, rows) + f"\n(perplexity gap to dense; {p.get('commit', '')}, {p.get('cpu', '')}; the decays "
            f"chosen: {'; '.join(spans(d['search']['chosen_decays']))})\n\nThe search (perplexity at {d['search']['args']['budget']} of 8K on the "
            f"training windows, last 1024 scored):\n\n" + table(shead, srows))


def t_hip_speed():
    """bench/results/hip_speed.json: hip_bank's step time at 128K x 1 and x 4 per variant, and its
    ratio to torch SDPA's in the same run."""
    d = load("hip_speed.json")
    if not d:
        return "(bench/results/hip_speed.json not yet generated)\n"
    batches = sorted({r["batch"] for r in d["rows"]})
    head = ["variant", "parameters"] + [f"128K x {b}: ms a step (x SDPA)" for b in batches]
    rows, order = [], []
    for r in d["rows"]:
        if r["variant"] not in order:
            order.append(r["variant"])
    for v in order:
        per = {r["batch"]: r for r in d["rows"] if r["variant"] == v}
        any_r = next(iter(per.values()))
        rows.append([f"`{v}`", hip_params_label(any_r)] + [
            f"{per[b]['ms_per_token_step']:.3f} ({per[b]['ratio']:.2f}x)" if b in per and per[b].get("ratio") else None
            for b in batches])
    sd = {r["batch"]: r.get("sdpa_ms_per_token_step") for r in d["rows"]}
    rows.append(["torch SDPA", "all KV on the GPU"] + [f"{sd[b]:.3f} (1.00x)" if sd.get(b) else None for b in batches])
    p = d["rows"][0].get("provenance", {})
    return table(head, rows) + (f"\n(real moving query; {p.get('commit', '')}, {p.get('gpu', '')}, "
                                f"{p.get('cpu', '')})\n")


def gemma_table(d):
    """A Gemma 3 results file (bench/reproduce.py gemma_merge): a row per budget (percent of the
    context) and lane (a policy and its parameters), its perplexity gap per (text, context) and
    passkey per length."""
    lane = lambda r: r["policy"] + "".join(f" {k}={v:g}" for k, v in (r.get("params") or {}).items())

    def pct(r, ctx):
        if r["policy"] == "dense" or r.get("budget") is None:
            return None
        return r.get("budget_pct") or round(100 * r["budget"] / ctx)
    cols = [(r["text"], r["context"]) for r in d["rows"] if r["policy"] == "dense"]
    by, pk = {}, {}
    for r in d["rows"]:
        by.setdefault((pct(r, r["context"]), lane(r)), {})[(r["text"], r["context"])] = r
    for g in d.get("passkey", []):
        for r in g["rows"]:
            pk.setdefault((pct(r, g["length"]), lane(r)), {})[g["length"]] = r
    lengths = [g["length"] for g in d.get("passkey", [])]
    name = lambda t: os.path.basename(t).replace(".txt", "").upper().replace("JARGON", "Jargon")
    head = ["budget", "policy"] + [f"{name(t)} {c // 1024}K: gap (/ oracle's)" for t, c in cols] + \
           [f"passkey {n // 1024}K" for n in lengths]
    order = ["dense", "oracle", "lfps", "sparcas", "quest", "hip", "kvpop", "streaming"]
    rank = lambda ln: (order.index(ln.split()[0]) if ln.split()[0] in order else 99, ln)
    rows = []
    for p, ln in sorted(by, key=lambda k: (k[0] or 0, rank(k[1]))):
        cells = ["all" if p is None else f"{p}%", f"`{ln}`"]
        for col in cols:
            r = by[(p, ln)].get(col)
            if not r or r.get("gap_pct") is None:
                cells.append(None)
                continue
            o = f" ({r['gap_over_oracle_gap']:.2f}x)" if r.get("gap_over_oracle_gap") else ""
            cells.append("0 (ppl %.3f)" % r["perplexity"] if ln == "dense" else f"{r['gap_pct']:+.2f}%{o}")
        for n in lengths:
            r = pk.get((p, ln), {}).get(n)
            cells.append(f"{r['found']}/{r['trials']}" if r else None)
        rows.append(cells)
    return table(head, rows)


def t_gemma_quality():
    """bench/results/quality_gemma3_32k.json: Gemma 3 270M, every policy at 2% of the context."""
    d = load("quality_gemma3_32k.json")
    return gemma_table(d) if d else "(bench/results/quality_gemma3_32k.json not yet generated)\n"


def t_sparcas_smooth():
    """bench/results/quality_gemma3_32k.json's sparcas lanes (smooth=0 and smooth=1) beside dense and
    the oracle, at 1%, 2% and 4% of the context."""
    d = load("quality_gemma3_32k.json")
    if not d:
        return "(bench/results/quality_gemma3_32k.json not yet generated)\n"
    keep = lambda r: r["policy"] in ("dense", "oracle", "sparcas")
    d = dict(d, rows=[r for r in d["rows"] if keep(r)],
             passkey=[dict(g, rows=[r for r in g["rows"] if keep(r)]) for g in d.get("passkey", [])])
    return gemma_table(d)


def t_sparcas_refresh():
    """bench/results/sparcas_refresh.json (speed: sparcas_bank at 128K over 130 steps, SDPA in the same
    run) beside bench/results/sparcas_refresh_smollm2.json (quality: perplexity gap to dense at 256)
    for each refresh interval u of SparCas's dimensions."""
    sp, q = load("sparcas_refresh.json"), load("sparcas_refresh_smollm2.json")
    if not sp or not q:
        return "(bench/results/sparcas_refresh.json or sparcas_refresh_smollm2.json not yet generated)\n"
    texts = texts_of(q["rows"])
    gap = {}
    for r in q["rows"]:
        key = (r["params"] or {}).get("u", r["policy"]) if r["policy"] == "sparcas" else r["policy"]
        gap[(key, r["text"])] = r
    # The merge's variant "u<u>" names the u a row asked for (the committed rows' params were written
    # by kvferry-e2e with 6 digits: 2^20 as 1.04858e+06).
    speed = {(int(r["variant"][1:]), r["batch"]): r for r in sp["rows"]}
    us = sorted({u for (u, _) in speed} | {k for (k, _) in gap if isinstance(k, int)})
    uname = lambda u: "never" if u >= 1 << 20 else str(u)
    head = ["u", "128K x 1: ms a step (/ SDPA)", "128K x 4: ms a step (/ SDPA)", "selection, 128K x 1: ms a step"] + \
           [f"{text_name(t)}: gap (/ oracle's)" for t in texts]
    rows = []
    for u in us:
        cells = [uname(u)]
        for b in (1, 4):
            r = speed.get((u, b))
            cells.append(f"{r['ms_per_token_step']:.2f} ({r['ratio']:.2f}x)" if r else None)
        r = speed.get((u, 1))
        cells.append(f"{r['ms_select_device_per_step']:.2f}" if r else None)
        for t in texts:
            r = gap.get((u, t))
            cells.append(f"+{r['gap_pct']:.2f}% ({r['gap_over_oracle_gap']:.2f}x)" if r else None)
        rows.append(cells)
    ps, pq = sp.get("provenance", {}), q.get("provenance", {})
    # A refresh's cost: u = 64 refreshes floor(steps / 64) times in the timed steps, never not at all.
    m = re.search(r"--steps (\d+)", ps.get("command", ""))
    note = ""
    t64, tnever = speed.get((64, 1)), speed.get((1 << 20, 1))
    if m and t64 and tnever and int(m.group(1)) >= 64:
        steps = int(m.group(1))
        per = (t64["ms_per_token_step"] - tnever["ms_per_token_step"]) * steps / (steps // 64)
        steady = lambda u: tnever["ms_per_token_step"] + per / u
        note = (f"\nA refresh at 128K x 1 costs about {per:.0f} ms (u = 64's {steps // 64} refreshes in the {steps} "
                f"timed steps against never), so the steady step is about {steady(64):.2f} ms at u = 64 and "
                f"{steady(256):.2f} ms at u = 256.\n")
    return table(head, rows) + note + (f"\n(speed: {ps.get('gpu', '')}, {ps.get('commit', '')}, {ps.get('date', '')}; "
                                f"quality: SmolLM2-135M, host backend, {pq.get('commit', '')}, {pq.get('cpu', '')})\n")


def t_budgets():
    """bench/results/budgets_smollm2.json: gap to dense (and over the oracle's) per policy, budget
    and text; the papers' budgets for hip / kvpop, Quest's page size at 256."""
    d = load("budgets_smollm2.json")
    if not d:
        return "(bench/results/budgets_smollm2.json not yet generated)\n"
    texts = sorted({r["text"] for r in d["rows"]}, key=lambda t: ("jargon" in t, t))
    name = lambda t: os.path.basename(t).replace(".txt", "").upper().replace("JARGON", "Jargon")
    by = {}
    for r in d["rows"]:
        ps = params_cell(r["policy"], r.get("params"), r)
        by.setdefault((r["budget"], r["policy"], ps), {})[r["text"]] = r
    order = ["oracle", "streaming", "quest", "hip", "kvpop"]
    head = ["budget of 8K", "policy", "parameters"] + [f"{name(t)}: gap (/ oracle's)" for t in texts]
    rows = []
    for (b, pol, ps) in sorted(by, key=lambda k: (k[0], order.index(k[1]) if k[1] in order else 99, k[2])):
        cells = [b, f"`{pol}`", ps]
        for t in texts:
            r = by[(b, pol, ps)].get(t)
            o = f" ({r['gap_over_oracle_gap']:.2f}x)" if r and r.get("gap_over_oracle_gap") and pol != "oracle" else ""
            cells.append(f"{r['gap_pct']:+.2f}%{o}" if r else None)
        rows.append(cells)
    return table(head, rows)


def t_real_model_gpu():
    """bench/results/real_model_gpu.json: SmolLM2-135M through kvferry-llama --backend cuda, every
    policy: perplexity and decode tokens/s per context, batch 8 at 8K, the bank hit rate of real
    queries, the largest perplexity difference to the host backend, passkey."""
    d = load("real_model_gpu.json")
    if not d:
        return "(bench/results/real_model_gpu.json not yet generated)\n"
    rows = d["rows"]
    ctxs = sorted({r["context"] for r in rows if r["batch"] == 1})
    pick = lambda p, c, b=1, bank=False: next((r for r in rows if r["policy"] == p and r["context"] == c and
                                               r["batch"] == b and ("bank_slots" in r) == bank), None)
    agree = {}
    for a in d.get("agreement", []):
        agree[a["policy"]] = max(agree.get(a["policy"], 0), a["rel_diff"])
    found = {}
    for pk in d.get("passkey", []):
        acc = {}
        for t in pk["trials"]:
            for lab, v in t["answers"].items():
                f, n = acc.get(lab.split("@")[0], (0, 0))
                acc[lab.split("@")[0]] = (f + bool(v["found"]), n + 1)
        found[pk["backend"]] = acc
    gpu = gpu_short(rows[0]) if rows else "—"
    big = max(ctxs)
    head = (["policy"] + [f"perplexity {c // 1024}K" for c in ctxs] + [f"tok/s {c // 1024}K b1" for c in ctxs] +
            [f"tok/s {big // 1024}K b8", f"b1 vs dense, {big // 1024}K", f"b1 / b8 vs resident, {big // 1024}K",
             f"bank hit {big // 1024}K",
             "max ppl diff to host", "passkey CUDA (host)"])
    out = []
    has_resident = any(r.get("decode_vs_dense_resident") for r in rows)

    def vs_resident(r):
        v = r.get("decode_vs_dense_resident") if r else None
        return f"{v:.2f}x" if v is not None else "—"
    lanes = ("dense_resident", "dense_resident_nographs", "dense", "oracle", "streaming", "lfps", "sparcas",
             "quest", "hip", "kvpop")
    for p in (x for x in lanes if any(r["policy"] == x for r in rows)):
        b1 = [pick(p, c) for c in ctxs]
        b8, bank = pick(p, big, 8), pick(p, big, 1, True)
        fc, fh = found.get("cuda", {}).get(p), found.get("host", {}).get(p)
        pkc = f"{fc[0]}/{fc[1]}" + (f" ({fh[0]}/{fh[1]})" if fh else "") if fc else None
        out.append([f"`{p}`"] + [r["perplexity"] if r else None for r in b1] +
                   [round(r["decode_tokens_per_second"], 1) if r else None for r in b1] +
                   [round(b8["decode_tokens_per_second"], 1) if b8 else None,
                    f"{b1[-1]['decode_vs_dense']:.2f}x" if b1[-1] and b1[-1].get("decode_vs_dense") else None,
                    f"{vs_resident(b1[-1])} / {vs_resident(b8)}" if b1[-1] and has_resident else None,
                    f"{bank['bank_hit_rate']:.2f}" if bank and bank.get("bank_hit_rate") is not None else None,
                    f"{100 * agree[p]:.2f}%" if p in agree else None, pkc])
    return table(head, out) + f"\n({gpu}, {rows[0]['provenance']['commit'] if rows else ''}; passkey: CUDA at 2K and 4K, the host backend at 2K, 3 depths each.)\n"


def t_hf_gpu():
    """bench/results/hf_gpu.json: Hugging Face transformers on the GPU, transformers' SDPA with its
    DynamicCache against attn_implementation="kvferry": decode tokens/s (and the ratio to SDPA
    without cuDNN of the same run), SmolLM2 at 8K batch 1 and 8, the 8B-shaped 8-layer model at 32K and 128K; the
    K/V kept in GPU memory and the greedy tokens equal to SDPA's at SmolLM2 8K batch 1."""
    d = load("hf_gpu.json")
    if not d:
        return "(bench/results/hf_gpu.json not yet generated)\n"
    rows = d["rows"]
    smol = next((r["model"] for r in rows if r["model"].startswith("SmolLM2")), None)
    big = next((r["model"] for r in rows if r["model"].startswith("llama8b")), None)
    pick = lambda m, c, b, lane: next((r for r in rows if r["model"] == m and r["context"] == c and
                                       r["batch"] == b and r["lane"] == lane and "skipped" not in r), None)

    def speed(r):
        if not r:
            return None
        base = r.get("decode_vs_sdpa_nocudnn")
        ratio = f" ({base:.2f}x)" if base is not None and r["lane"] != "sdpa_nocudnn" else ""
        return f"{r['decode_tokens_per_second']:.1f}{ratio}"
    head = ["lane", "SmolLM2 8K b1 tok/s", "SmolLM2 8K b8 tok/s", "same tokens as SDPA, 8K b1",
            "K/V in GPU memory, 8K b1", "8B-shape 32K b1 tok/s", "8B-shape 128K b1 tok/s"]
    out = []
    for lane in dict.fromkeys(r["lane"] for r in rows):
        a, b = pick(smol, 8192, 1, lane), pick(smol, 8192, 8, lane)
        out.append([f"`{lane}`", speed(a), speed(b),
                    f"{a['same_tokens']}/{a['tokens_compared']}" if a and a.get("same_tokens") is not None else None,
                    f"{a['kv_gpu_bytes'] / 2**20:.1f} MiB" if a else None,
                    speed(pick(big, 32768, 1, lane)), speed(pick(big, 131072, 1, lane))])
    p = rows[0]["provenance"] if rows else {}
    return table(head, out) + (f"\n({gpu_short(rows[0]) if rows else '—'}, {p.get('commit', '')}, transformers "
                               f"{rows[0].get('transformers', '?')}, torch {rows[0].get('torch', '?')}; in parentheses: "
                               "the ratio to `sdpa_nocudnn`'s tokens/s in the same run: transformers' SDPA with torch's "
                               "cuDNN backend excluded, the sound baseline, as `sdpa` with cuDNN pays a graph build "
                               "every decode step.)\n")


TABLES = {"query": t_query, "policy": t_policy, "e2e": t_e2e, "prefill": t_prefill, "scale": t_scale,
          "quality": t_quality, "kernels": t_kernels, "cpu": t_cpu,
          "prefill-host": t_prefill_host, "transfer": t_transfer, "hip-replay": t_hip_replay,
          "hip-quality": t_hip_quality, "hip-drift": t_hip_drift, "knorm": t_knorm, "hip-speed": t_hip_speed, "kvpop-decay": t_kvpop_decay, "gemma-quality": t_gemma_quality, "budgets": t_budgets,
          "sparcas-smooth": t_sparcas_smooth, "sparcas-refresh": t_sparcas_refresh, "real-model-gpu": t_real_model_gpu,
          "hf-gpu": t_hf_gpu}


def doc_files():
    files = [os.path.join(ROOT, "README.md")]
    docs = os.path.join(ROOT, "docs")
    if os.path.isdir(docs):
        files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return [f for f in files if os.path.exists(f)]


def render(text, cache):
    def sub(m):
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"docs_tables.py: unknown table '{name}' (known: {', '.join(TABLES)})")
        if name not in cache:
            cache[name] = TABLES[name]()
        return m.group(1) + cache[name] + m.group(4)
    return MARK.sub(sub, text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 with the diff when a table is stale")
    ap.add_argument("--list", action="store_true", help="print the table names")
    a = ap.parse_args()
    if a.list:
        print("\n".join(TABLES))
        return 0
    cache, stale = {}, 0
    for path in doc_files():
        with open(path) as f:
            old = f.read()
        new = render(old, cache)
        if new == old:
            continue
        rel = os.path.relpath(path, ROOT)
        if a.check:
            stale += 1
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       f"{rel} (as committed)", f"{rel} (from bench/results)"))
        else:
            with open(path, "w") as f:
                f.write(new)
            print(f"docs_tables.py: {rel} updated")
    if stale:
        print(f"docs_tables.py: {stale} file(s) disagree with bench/results; run python3 scripts/docs_tables.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
