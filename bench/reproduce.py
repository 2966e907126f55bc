#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Regenerates one results file, bench/results/NAME.json, on the machine at hand, in one run.

  python3 bench/reproduce.py --list          the names, whether each needs a GPU, what it measures,
                                             the machine kind and the estimated run time
  python3 bench/reproduce.py NAME            build what NAME needs, run it (baselines included),
                                             write bench/results/NAME.json (.jsonl for the
                                             JSON-lines file bank_hit_smollm2_kjv4k)
  python3 bench/reproduce.py NAME --dry-run  print the commands only

Every row written carries "provenance": the commit (git rev-parse HEAD, "+dirty" when the tree has
changes; KVFERRY_SOURCE_COMMIT overrides it for a tree copied without its history), the date, the GPU and driver (nvidia-smi, when present), the CPU model and core count
(/proc/cpuinfo), and the exact commands of the run. Environment: B (build folder, default
build-release), T (scratch folder, default /tmp/kvferry-reproduce/NAME), KVFERRY_CUDA_ARCHS (default
90), JOBS (build jobs, default all cores). Without CUDA the GPU names refuse to run and say so.
docs/benchmarks.md says what each file measures and on which machine its committed rows ran.
"""
import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "bench", "results")
B = os.environ.get("B", "build-release")  # relative to the repository root, where commands run
PY = "python3"
E2E = f"{B}/bench/kvferry-e2e"
LLAMA = f"{B}/examples/llama/kvferry-llama"
BENCH = f"{B}/bench/kvferry-bench"
MODEL = "data/SmolLM2-135M-Instruct.Q4_1.gguf"


def host_gib():
    try:
        kb = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
        return max(8, kb // 1048576 - 24)
    except (OSError, StopIteration):
        return 64


# ------------------------------------------------------------------------------------------ specs
# Each spec: gpu (needs CUDA), targets (CMake targets to build), examples (needs the examples
# built), what (one line), run(T) -> list of commands (strings run by bash from the repository
# root), merge(T) -> the JSON object to write (its rows get provenance).

# e2e: the decode step per token at 32K and 128K, batch 1 and 4, with the query that moves as
# real decoding does (--query real, bench/results/query_calibration.json) and, at batch 1, the
# repeated query (the token bank's best case) beside it; dense_resident and full streaming as the
# in-run baselines, torch SDPA by scripts/device/e2e_sdpa.py; chunked prefill. Sized for one
# 10-minute call on the GPU machine (a 128K x 4 row fills 16 GiB of keys first: ~40 s).
E2E_MODES = "streaming,sparcas_bank,quest_bank,hip_bank,kvpop_bank,xl+sparcas_bank"
E2E_MODES_B4 = "sparcas_bank,quest_bank,hip_bank,kvpop_bank"


def e2e_cmds(T):
    base = f"{E2E} --unique-kv --steps 8"
    return [
        f"{base} --contexts 32768,131072 --batches 1 --modes dense_resident,streaming_resident,{E2E_MODES} "
        f"--json {T}/repeated_b1.jsonl",
        f"{base} --query real --contexts 32768,131072 --batches 1 --modes {E2E_MODES},oracle_bank,lfps "
        f"--json {T}/real_b1.jsonl",
        f"{base} --query real --contexts 131072 --batches 4 --modes {E2E_MODES_B4} --json {T}/real_b4.jsonl",
        f"{E2E} --unique-kv --steps 2 --contexts 32768,131072 --batches 1 --modes full_streaming --json {T}/full.jsonl",
        f"{E2E} --contexts 32768,131072 --modes prefill_dense --prefill-chunks 8192 --prefill-order layer "
        f"--json {T}/prefill.jsonl",
        f"cat {T}/*.jsonl > {T}/rows.jsonl",
        f"{PY} scripts/device/e2e_sdpa.py {T}/rows.jsonl {T}/e2e_sdpa.json",
    ]


def label_query(rows):
    """Every decode row says which query it ran with: kvferry-e2e writes "query" ("real", "repeated
    (best case)" or "moving (drift E, rho R)"); a row without it ran before the query model and
    is labelled from its query_drift. Prefill rows have no decode query."""
    for r in rows:
        if isinstance(r, dict) and not str(r.get("mode", "")).startswith("prefill") and "query" not in r:
            drift = float(r.get("query_drift", 0) or 0)
            r["query"] = f"moving (drift {drift:g})" if drift else "repeated (best case)"
    return rows


def e2e_merge(T):
    d = json.load(open(f"{T}/e2e_sdpa.json"))
    label_query(d.get("rows", []))
    d["bench"] = "kvferry-e2e (bench/e2e_bench.cu) + torch SDPA in the same run (scripts/device/e2e_sdpa.py)"
    d["regenerate"] = "python3 bench/reproduce.py e2e"
    return d


SCALE_POINTS = [(32768, 4), (131072, 1), (131072, 4), (524288, 1)]
SCALE_DENSE = [(32768, 1), (49152, 1), (57344, 1), (131072, 1), (32768, 2)]


def sdpa_pending(T):
    """torch SDPA for every kvferry-e2e output in T that has none yet, in one torch process."""
    return (f"pairs=$(for f in {T}/*.jsonl; do [ -e \"${{f%.jsonl}}.sdpa.json\" ] || echo \"$f ${{f%.jsonl}}.sdpa.json\"; "
            f"done); [ -z \"$pairs\" ] || {PY} scripts/device/e2e_sdpa.py $pairs")


def scale_cmds(T):
    """Each point: the four device policies with the token bank, the two baselines, and sparcas /
    kvpop without a bank on the scheduler's route (auto: its GPU/CPU split of the misses); the
    real, moving query. Every row fills its own runtime (about 0.5 s a GiB of KV), so the whole
    file is about 13 minutes of a one-GPU machine: on one whose calls stop at 10 minutes, run it in parts on the
    same warm machine with the same T, SCALE_POINTS=CxN[,CxN] (SCALE_POINTS=dense: the
    dense_resident capacity rows), then once with --merge-only."""
    H = host_gib()
    cap = f"--unique-kv --gpu-gib 8 --host-gib {H} --query real"
    sel = os.environ.get("SCALE_POINTS", "")
    want = None if not sel else {tuple(int(x) for x in p.split("x")) for p in sel.split(",") if p != "dense"}
    cmds = []
    for c, n in SCALE_POINTS:
        if want is not None and (c, n) not in want:
            continue
        need = c * n * 128 // 1048576  # GiB of host KV (128 KiB a token)
        if need * 1.05 > H:
            cmds.append(f"echo 'scale: {c}x{n} needs {need} GiB of host KV, this machine gives {H}: skipped'")
            continue
        p = f"{T}/p{c}x{n}"
        cmds += [
            f"{E2E} {cap} --contexts {c} --batches {n} --steps 8 --modes kvpop_bank,quest_bank,sparcas_bank,"
            f"hip_bank --json {p}_bank.jsonl",
            f"{E2E} {cap} --contexts {c} --batches {n} --steps 2 --modes full_streaming,dense_cpu --json {p}_base.jsonl",
            f"{E2E} {cap} --contexts {c} --batches {n} --steps 8 --modes sparcas,kvpop --route auto --json {p}_route_auto.jsonl",
        ]
    if want is None or "dense" in sel.split(","):
        cmds += [f"{E2E} {cap} --contexts {c} --batches {n} --steps 8 --modes dense_resident "
                 f"--json {T}/dense_{c}x{n}.jsonl" for c, n in SCALE_DENSE]
    cmds.append(sdpa_pending(T))
    return cmds


def scale_merge(T):
    rows = []
    for f in sorted(glob.glob(f"{T}/*.sdpa.json")):
        tag = os.path.basename(f).split(".")[0]
        for r in json.load(open(f))["rows"]:
            r["_file"] = tag
            rows.append(r)
    base = {}
    for r in rows:
        if r["_file"].endswith("_base") and "skipped" not in r:
            base[(r["context"], r["batch"], r["mode"])] = r["ms_per_token_step"]
    out = []
    for r in rows:
        tag = r.pop("_file")
        route_kind = tag.split("_route_")[1] if "_route_" in tag else None
        mode = r["mode"]
        policy = mode.split("+")[-1].replace("_bank", "").replace("_resident", "")
        row = {"policy": "dense" if mode in ("full_streaming", "dense_cpu", "dense_resident") else policy,
               "mode": mode, "selectors": "+".join(mode.split("+")[:-1]) or "none",
               "context": r["context"], "batch": r["batch"],
               "route": "cpu" if mode == "dense_cpu" else (route_kind or r.get("route", "gpu")),
               "gpu_bytes_cap": 8 << 30, "query_drift": r.get("query_drift", 0)}
        if r.get("query"):
            row["query"] = r["query"]  # kvferry-e2e's own label ("real", ...)
        label_query([row])
        row.pop("query_drift")
        if route_kind:  # scale_cmds runs route auto only: the scheduler's split
            row["mode"] = f"{mode} (split)"
        if "skipped" in r:
            out.append({**row, "skipped": r["skipped"]})
            continue
        # A route row's time is the eager step (a captured step holds no host work).
        ms = r.get("ms_per_token_step_no_graph") if route_kind else r["ms_per_token_step"]
        fs = base.get((r["context"], r["batch"], "full_streaming"))
        dc = base.get((r["context"], r["batch"], "dense_cpu"))
        sdpa = r.get("sdpa_ms_per_token_step")
        row.update(ms_per_token_step=ms, tokens_per_s=round(r["batch"] * 1e3 / ms, 1),
                   speedup_vs_full_streaming=round(fs / ms, 2) if fs else None,
                   speedup_vs_dense_cpu=round(dc / ms, 2) if dc else None,
                   sdpa_uncapped_ms_per_token_step=sdpa, ratio_vs_sdpa_uncapped=ms / sdpa if sdpa else None)
        row.update({k: r[k] for k in ("gpu_bytes", "host_bytes", "bank_slots", "bank_hit_rate",
                                      "rows_selected_per_step", "rows_bank_hit_per_step",
                                      "rows_fetched_per_step", "rows_cpu_per_step", "decode_split_per_step",
                                      "split_share", "host_syncs_per_step", "capture_safe",
                                      "stages_ms_per_step", "fill_s", "unique_kv") if k in r})
        if route_kind:
            row["ms_per_token_step_graph"] = r.get("ms_per_token_step")
        out.append(row)
    return {"bench": "kvferry-e2e under an 8 GiB device-memory cap (--gpu-gib 8), 32 layers of the "
                     "Llama-3.1-8B attention shape, budget 2%",
            "regenerate": "python3 bench/reproduce.py scale", "rows": out}


def split_cmds(T):
    H = host_gib()
    cap = f"--unique-kv --gpu-gib 8 --host-gib {H} --contexts 131072 --batches 1,4 --steps 8 --modes sparcas,kvpop"
    return [f"{E2E} {cap} --route gpu --json {T}/gpu.jsonl",
            f"{E2E} {cap} --route auto --json {T}/auto.jsonl",
            f"{E2E} {cap} --split-share 1 --route auto --json {T}/cpu.jsonl"]


def split_merge(T):
    rows = []
    for kind in ("gpu", "auto", "cpu"):
        for l in open(f"{T}/{kind}.jsonl"):
            if l.strip():
                r = json.loads(l)
                r["route"] = {"gpu": "gpu", "auto": "split", "cpu": "cpu"}[kind]
                rows.append(r)
    label_query(rows)
    return {"what": "the scheduler's split inside the planned step: device-selected policies (2%) "
                    "without a bank, route gpu vs the split (route auto) vs every miss on the CPU "
                    "(--split-share 1), 8 GiB cap", "regenerate": "python3 bench/reproduce.py split",
            "rows": rows}


def quality_cmds(T):
    L = f"{LLAMA} --model {MODEL}"
    ppl = "--perplexity --text data/kjv.txt --context 8192 --scored 1024 --backend host --lanes-together"
    pk = "--passkey --text data/kjv.txt --backend host --lanes-together"
    W = "--policy-weights policies/weights/kvpop_smollm2.safetensors"
    cmds = [
        "bash scripts/fetch-data.sh",
        f"{L} {ppl} --policy streaming,oracle,quest,sparcas,hip,lfps --budget 256,512 --json {T}/ppl.json",
        f"{L} {ppl} {W} --policy kvpop --budget 256,512 --no-dense --json {T}/ppl_kvpop.json",
        f"{L} {ppl} --policy kvpop --param scorer=2 --budget 256,512 --no-dense --json {T}/ppl_kvpop2.json",
        f"{L} {ppl} --policy sparcas --param bits=16 --param d_b=8 --budget 256,512 --no-dense --json {T}/ppl_sparcas16.json",
        f"{L} {ppl} --policy hip --param bits=16 --param align=0 --budget 256,512 --no-dense --json {T}/ppl_hip32.json",
        f"{L} {pk} --lengths 2048,4096 --depths 0.1,0.5,0.9 --policy streaming,oracle,quest,sparcas,hip,lfps "
        f"--budget 256 --json {T}/passkey_24k.json",
        f"{L} {pk} {W} --lengths 2048,4096 --depths 0.1,0.5,0.9 --policy kvpop --budget 256 --no-dense --json {T}/passkey_kvpop.json",
        f"{L} {pk} --lengths 8192 --depths 0.5 --policy oracle,quest,sparcas,lfps --budget 256 --json {T}/passkey_8k.json",
        f"{L} --dump-trace {T}/kjv4k.safetensors --text data/kjv.txt --offset-lines 1000 --context 4096 "
        f"--trace-layers all --trace-steps 1 --policy dense --backend host",
        # kvpop replays with its trained scorer, as its perplexity runs (its zero scorer would keep
        # the newest rows and replay as streaming).
        *[f"{BENCH} --trace {T}/kjv4k.safetensors --policy {p} --budget {b} --steps 64 --sink 4 --window 64 "
          f"--kv-dtype f16 --backend host{' ' + W if p == 'kvpop' else ''} --json {T}/replay_{p}_{b}.jsonl"
          for p in ("streaming", "oracle", "quest", "sparcas", "hip", "lfps", "kvpop") for b in (256, 512)],
        f"{PY} scripts/quality_smollm2.py --ppl {T}/ppl.json {T}/ppl_kvpop.json {T}/ppl_kvpop2.json@scorer=2 "
        f"{T}/ppl_sparcas16.json@bits=16,d_b=8 {T}/ppl_hip32.json@bits=16,align=0 --passkey {T}/passkey*.json "
        f"--replay {T}/replay_*.jsonl --out {T}/quality.json",
    ]
    return cmds



# Gemma 3 270M (32K context; 3 global layers take the policy, 15 sliding layers their window):
# perplexity of the last 1024 tokens of 16K and 32K windows of KJV and the Jargon File, and passkey
# at 8K/16K/32K x 3 depths, every policy at 1%, 2% and 4% of the context on the global layers,
# dense beside. The lanes decode each step together (--lanes-together: the weights read once a
# step for all of them), which is what makes 25 lanes affordable on 2 cores.
GEMMA = "data/gemma-3-270m-q4_k_m.gguf"
GEMMA_POLICIES = "oracle,streaming,lfps,lfps:scan=64,sparcas:smooth=0,sparcas:smooth=1,quest,hip,kvpop"
GEMMA_PCTS = (1, 2, 4)


def gemma_budgets(ctx, pcts):
    return ",".join(str(ctx * p // 100) for p in pcts)


def gemma_cmds(T, lanes, lengths, pcts=GEMMA_PCTS, together=True, streams=1):
    """Perplexity of the last 1024 tokens of 16K and 32K windows of KJV and Jargon, and passkey at
    `lengths` x 3 depths, for the --policy lanes `lanes` at `pcts` percent of the context, dense
    beside (`together`: the lanes of a run decode each step at once). streams=2: two chains side by
    side, one core each (KJV's windows, the shorter passkeys and the longest at depth 0.9; the
    Jargon File's windows and the longest passkey at depths 0.1 and 0.5)."""
    L = f"{LLAMA} --model {GEMMA} --backend host" + (" --lanes-together" if together else "") + \
        (" --cpu-threads 1" if streams > 1 else "")
    ppl = {(text, ctx): f"{L} --perplexity --text data/{text}.txt --context {ctx} --scored 1024 --policy {lanes} "
                        f"--budget {gemma_budgets(ctx, pcts)} --json {T}/ppl_{text}_{ctx}.json"
           for ctx in (16384, 32768) for text in ("kjv", "jargon")}

    def pk(n, depths="0.1,0.5,0.9", part=""):
        return (f"{L} --passkey --text data/kjv.txt --lengths {n} --depths {depths} --policy {lanes} "
                f"--budget {gemma_budgets(n, pcts)} --json {T}/passkey_{n}{part}.json")
    cmds = ["bash scripts/fetch-data.sh --text-only", "bash scripts/fetch-data.sh --gemma3"]
    if streams > 1:
        n = max(lengths)
        a = [ppl["kjv", 16384], ppl["kjv", 32768]] + [pk(m) for m in lengths if m != n] + [pk(n, "0.9", "_b")]
        b = [ppl["jargon", 16384], ppl["jargon", 32768], pk(n, "0.1,0.5", "_a")]
        cmds.append(side_by_side(" && ".join(a), " && ".join(b)))
    else:
        cmds += [ppl["kjv", 16384], ppl["jargon", 16384], ppl["kjv", 32768], ppl["jargon", 32768]]
        cmds += [pk(m) for m in lengths]
    for ctx in (16384, 32768):
        for text in ("kjv", "jargon"):
            cmds.append(f"{PY} scripts/quality_smollm2.py --ppl {T}/ppl_{text}_{ctx}.json --out {T}/q_{text}_{ctx}.json "
                        f"--no-plot")
    for n in lengths:
        cmds.append(f"{PY} scripts/quality_smollm2.py --passkey {T}/passkey_{n}*.json --out {T}/q_passkey_{n}.json --no-plot")
    return cmds


def budget_pct(budget, ctx):
    """A lane's budget as the percent of the context it was set from (dense: None)."""
    return None if budget is None else round(100 * budget / ctx)


def gemma_merge(T, bench, lengths, notes):
    """gemma_cmds' outputs as one results file: rows per (text, context, lane), passkey per length;
    each row with its budget_pct."""
    rows, passkey = [], []
    for ctx in (16384, 32768):
        for text in ("kjv", "jargon"):
            for r in json.load(open(f"{T}/q_{text}_{ctx}.json"))["rows"]:
                r.pop("passkey", None)
                rows.append(dict(r, text=f"data/{text}.txt", context=ctx,
                                 budget_pct=budget_pct(r.get("budget"), ctx)))
    for n in lengths:
        if not os.path.exists(f"{T}/q_passkey_{n}.json"):  # a run cut short: the length is left out
            continue
        q = json.load(open(f"{T}/q_passkey_{n}.json"))
        passkey.append({"length": n,
                        "rows": [{"policy": r["policy"], "params": r["params"], "budget": r["budget"],
                                  "budget_pct": budget_pct(r["budget"], n), **r["passkey"]}
                                 for r in q["rows"] if "passkey" in r]})
    return {"bench": bench, "model": GEMMA, "notes": notes, "rows": rows, "passkey": passkey,
            "regenerate": f"python3 bench/reproduce.py {bench}"}


GEMMA_NOTE = ("Gemma 3 270M (Q4_K_M GGUF), host backend, sinks 4 + window 64 on the 3 global layers; the 15 "
              "sliding-window layers (512 tokens) attend their window exactly. Budgets in percent of the "
              "context (the tokens a global layer attends, resident ones included).")
TOGETHER_NOTE = (" The lanes of a run decode each step together (--lanes-together), so a row's "
                 "decode_seconds is the time of all of them.")


def quality_gemma3_cmds(T):
    return gemma_cmds(T, GEMMA_POLICIES, (8192, 16384, 32768), streams=2)


def quality_gemma3_merge(T):
    return gemma_merge(T, "quality_gemma3_32k", (8192, 16384, 32768),
                       [GEMMA_NOTE + TOGETHER_NOTE + " sparcas runs with smooth=0 and smooth=1 (its channel scales) as "
                        "two lanes, lfps with its default scan of 16 channels and with 64 (a quarter of Gemma's "
                        "256 dimensions, as 16 is of SmolLM2's 64). kvpop runs without trained weights (no Gemma scorer exists: its recency "
                        "fallback)."])


def quality_merge(T):
    d = json.load(open(f"{T}/quality.json"))
    d["regenerate"] = "python3 bench/reproduce.py quality_smollm2"
    d["notes"] = ("The lanes of a perplexity or passkey run decode each step together (--lanes-together), "
                  "so a row's decode_seconds is the time of all the lanes of its run.")
    return d


def simple(target, args, gpu, what, out_name=None, examples=False):
    """A benchmark binary that writes the JSON itself: {B}/bench/target args OUT."""
    def cmds(T):
        return [f"{B}/bench/{target} {args.format(T=T, OUT=f'{T}/out.json')}".strip()]

    def merge(T):
        return json.load(open(f"{T}/out.json"))
    return dict(gpu=gpu, targets=[target], what=what, run=cmds, merge=merge, examples=examples)


def torch_sdpa_cmds(T):
    return [f"{B}/bench/gpu_attention_bench {T}/gpu_attention.json",
            f"{PY} scripts/device/torch_sdpa.py {T}/out.json --ours {T}/gpu_attention.json"]


def prefill_host_cmds(T):
    return [f"bash scripts/prefill-host-bench.sh --out {T}/out.json"]


def soak_cmds(T):
    return [f"{B}/tests/kvferry_soak --steps 1000000 --out {T}/out.json"]


def trace_cmds(T):
    return [f"{E2E} --unique-kv --gpu-gib 8 --contexts 32768 --batches 4 --steps 8 --modes kvpop --route auto "
            f"--trace {T}/trace --json {T}/rows.jsonl",
            f"cp \"$(ls {T}/trace*.json | head -1)\" {T}/out.json"]


def load_out(T):
    return json.load(open(f"{T}/out.json"))


# ------------------------------------------------------------------ studies on SmolLM2 (CPU) and LFPS's step (GPU)
# Each was a hand-run study; these entries are its procedure as one run with the current tools,
# baselines (dense, oracle, streaming) in the same run, merged into the schema of the committed file.
FETCH = "bash scripts/fetch-data.sh"
HOST_PPL = f"{LLAMA} --model {MODEL} --perplexity --backend host"
SMOLLM2_KV_HEADS = 3  # SmolLM2-135M: 9 query heads, 3 KV heads, 30 layers


def jload(path):
    with open(path) as f:
        return json.load(f)


def lanes_of(path):
    """kvferry-llama --perplexity --json: {lane label: lane}."""
    return {l["lane"]: l for l in jload(path)["lanes"]}


def gaps(lanes):
    """gap_pct to dense and gap_over_oracle_gap (oracle at the same budget) on {label: row}."""
    dense = lanes.get("dense", {}).get("perplexity")
    for lab, r in lanes.items():
        if dense and r.get("perplexity") is not None:
            r["gap_pct"] = 100.0 * (r["perplexity"] / dense - 1)
    for lab, r in lanes.items():
        b = lab.split("@")[1] if "@" in lab else None
        o = lanes.get(f"oracle@{b}") if b else None
        if o and o.get("gap_pct") and "gap_pct" in r:
            r["gap_over_oracle_gap"] = r["gap_pct"] / o["gap_pct"]
    return lanes


def trace_cmd(out, text, off, context, steps=1, layers="all", dtype=None):
    d = f" --trace-dtype {dtype}" if dtype else ""
    return (f"{LLAMA} --model {MODEL} --dump-trace {out} --text {text} --offset-lines {off} --context {context} "
            f"--trace-layers {layers} --trace-steps {steps}{d} --policy dense --backend host")


# lfps_quality_smollm2: LFPS before (the paper's candidates: rank=0 fill=0 scan=0) and after (the
# defaults) vs dense / streaming / oracle, KJV and the Jargon File, 4K window, last 1024 scored.
LFPS_TEXTS = (("kjv", 1000), ("jargon", 3000))
LFPS_PAPER = "--param rank=0 --param fill=0 --param scan=0"


def lfps_quality_cmds(T):
    cmds = [FETCH]
    for text, off in LFPS_TEXTS:
        base = f"{HOST_PPL} --text data/{text}.txt --offset-lines {off} --context 4096 --scored 1024"
        cmds += [f"{base} --policy streaming,oracle --budget 256,512 --json {T}/{text}_base.json",
                 f"{base} --policy lfps --budget 256,512 --no-dense --json {T}/{text}_after.json",
                 f"{base} --policy lfps --budget 256,512 --no-dense {LFPS_PAPER} --json {T}/{text}_before.json"]
    return cmds


def lfps_quality_merge(T):
    texts = {}
    for text, off in LFPS_TEXTS:
        lanes = {}
        for part, tag in (("base", None), ("before", "lfps_before"), ("after", "lfps_after")):
            d = jload(f"{T}/{text}_{part}.json")
            for l in d["lanes"]:
                st = l.get("stats") or {}
                lab = l["lane"] if tag is None else l["lane"].replace("lfps", tag, 1)
                lanes[lab] = {"perplexity": l["perplexity"], "argmax_agree": l["argmax_agree"],
                              "decode_seconds": l["decode_seconds"],
                              "rows_selected_per_head_step":
                                  st["rows_selected"] / (st["decode_steps"] * SMOLLM2_KV_HEADS)
                                  if st.get("decode_steps") else None,
                              "ms_select_per_token": st.get("ms_select", 0.0) / d["scored"]}
        order = ["dense", "streaming@256", "streaming@512", "oracle@256", "oracle@512", "lfps_before@256",
                 "lfps_before@512", "lfps_after@256", "lfps_after@512"]
        texts[text] = {"text": f"data/{text}.txt from line {off}",
                       "lanes": {k: lanes[k] for k in order if k in lanes}}
        gaps(texts[text]["lanes"])
    c = lfps_quality_cmds("OUT")
    return {"bench": "lfps_quality_smollm2", "model": "SmolLM2-135M-Instruct Q4_1", "kv_dtype": "f16",
            "sink": 4, "window": 64, "context": 4096, "scored": 1024, "backend": "host",
            "before": "the paper's LFPS (rank=0 fill=0 scan=0), same binary",
            "after": "LFPS defaults (rank=1 fill=1 scan=16 scan_factor=2 scan_max_period=8)",
            "texts": texts,
            "commands": {"base (dense, streaming, oracle)": c[1], "lfps_after": c[2], "lfps_before": c[3],
                         "texts": "; ".join(f"data/{t}.txt --offset-lines {o}" for t, o in LFPS_TEXTS)},
            "regenerate": "python3 bench/reproduce.py lfps_quality_smollm2"}


# lfps_recall_smollm2: lfps_bench --trace replays of every layer and KV head of two 4K traces.
LFPS_RECALL_RUNS = [  # (run, text, label, extra flags)
    ("kjv_after", "kjv", "after", ""),
    ("kjv_before", "kjv", "before", LFPS_PAPER),
    ("kjv_histonly", "kjv", "hist_only", "--param scan=0"),
    ("kjv_scan8", "kjv", "scan8", "--param scan=8"),
    ("kjv_scan16f1", "kjv", "scan16_factor1", "--param scan_factor=1"),
    ("kjv_perhead", "kjv", "per_head_256_cap_512", "--budgets 512 --detail-budget 512 --param per_head_budget=256"),
    ("jargon_after", "jargon", "after", ""),
    ("jargon_before", "jargon", "before", LFPS_PAPER),
    ("jargon_perhead", "jargon", "per_head_256_cap_512",
     "--budgets 512 --detail-budget 512 --param per_head_budget=256"),
]
PER_LAYER_FIELDS = ("recall_off", "mass", "oracle_mass", "streaming_mass", "scored_frac", "bypass_frac",
                    "fresh_frac")


def lfps_recall_cmds(T):
    cmds = [FETCH] + [trace_cmd(f"{T}/{t}4k.safetensors", f"data/{t}.txt", o, 4096) for t, o in LFPS_TEXTS]
    for run, text, label, extra in LFPS_RECALL_RUNS:
        cmds.append(f"{B}/bench/lfps_bench --trace {T}/{text}4k.safetensors --sink 4 --window 64 --kv-dtype f16 "
                    f"--label {label} {extra} --json {T}/{run}.json".replace("  ", " "))
    return cmds


def lfps_recall_merge(T):
    runs = {}
    for run, text, label, _ in LFPS_RECALL_RUNS:
        d = jload(f"{T}/{run}.json")
        per = {}
        for h in d.get("per_head", []):
            per.setdefault(h["layer"], []).append(h["all"])
        per_layer = {}
        for layer, hs in sorted(per.items()):
            row = {k: round(sum(x[k] for x in hs) / len(hs), 4) for k in PER_LAYER_FIELDS}
            row["lost"] = {k: round(sum(x["lost"][k] for x in hs) / len(hs), 4) for k in hs[0]["lost"]}
            per_layer[str(layer)] = row
        runs[run] = {"label": label, "params": d.get("params", {}), "trace_text": d.get("text"),
                     "budgets": d["budgets"], "per_layer_budget": d.get("per_head_budget"), "per_layer": per_layer}
    c = lfps_recall_cmds("T")
    return {"bench": "lfps_recall_smollm2",
            "how": "bench/micro/lfps_bench --trace: teacher-forced replay of every layer and KV head over the last "
                   "1024 positions of a 4096-token kvferry-llama trace, primed from the last prefill chunk; K/V "
                   "stored f16; sink 4, window 64",
            "metrics": {"recall_off": "|chosen offloaded ∩ exact top-k| / k, k = budget - sink - window, exact = "
                                      "the group summed softmax over all n keys (the oracle policy ranking), "
                                      "offloaded part",
                        "recall_all": "kvferry-bench metric: |selection ∩ oracle top-budget over all n| / budget",
                        "mass": "attention mass selected (mean over the group)",
                        "scored_frac": "keys given an exact q.k / offloaded keys",
                        "lost": "share of the exact top-k lost, by reason"},
            "runs": runs,
            "commands": {"trace": c[1], **{r[0]: c[3 + i] for i, r in enumerate(LFPS_RECALL_RUNS)}},
            "regenerate": "python3 bench/reproduce.py lfps_recall_smollm2"}


# lfps_step_profile (GPU): kvferry-e2e --modes lfps at 32K and 64K with the policy's phase timers
# (lfps parameter profile=1, printed on stderr when a row's Runtime is destroyed) and one traced step.
STEP_VARIANTS = [  # (variant, params for the row, env, extra flags)
    ("default", {}, "", ""),
    ("scan0", {"scan": 0}, "", "--param scan=0"),
    ("threads8", {"cpu_threads": 8}, "", "--cpu-threads 8"),
    ("scan_every_step", {"scan_max_period": 1}, "", "--param scan_max_period=1"),
    ("pool_warm500", {}, "", "--cpu-spin-us 500"),
]
STEP_REPEATS = 2


def step_profile_cmds(T):
    cmds = []
    for rep in range(1, STEP_REPEATS + 1):  # interleaved: the machine's drift falls on every variant
        for v, _, env, extra in STEP_VARIANTS:
            tag = f"{v}_{rep}"
            cmds.append(f"{env}{E2E} --contexts 32768,65536 --batches 1 --steps 8 --modes lfps --param profile=1 "
                        f"{extra} --trace {T}/{tag} --json {T}/{tag}.jsonl 2> {T}/{tag}.log".replace("  ", " "))
    cmds.append(sdpa_pending(T))
    return cmds


def lfps_profile_lines(path):
    out = []
    for line in open(path, errors="replace"):
        if line.startswith("lfps profile:") and "us per select:" in line:
            toks = line.split("us per select:", 1)[1].split()
            out.append({toks[i]: float(toks[i + 1]) for i in range(0, len(toks) - 1, 2)})
    return out


def trace_step_fields(path):
    """From one traced step (Chrome trace): the step's span, each layer's host select stage, the
    (sequence, KV head) pool items inside it (cpu_item), and when the last item started."""
    if not os.path.exists(path):
        return {}
    ev = [e for e in jload(path).get("traceEvents", []) if e.get("ph") == "X"]
    if not ev:
        return {}
    sel = [e for e in ev if e["name"] == "select" and e.get("cat") == "stage"]
    items = [e for e in ev if e["name"] == "cpu_item"]
    slow, mean, last = [], [], []
    for s in sel:
        inside = [i for i in items if s["ts"] <= i["ts"] <= s["ts"] + s["dur"]]
        if inside:
            slow.append(max(i["dur"] for i in inside))
            mean.append(sum(i["dur"] for i in inside) / len(inside))
            last.append(max(i["ts"] for i in inside) - s["ts"])
    avg = (lambda xs: round(sum(xs) / len(xs), 1) if xs else None)
    return {"traced_step_us": round(max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev), 1),
            "select_us_per_layer": avg([s["dur"] for s in sel]), "slowest_item_us": avg(slow),
            "mean_item_us": avg(mean), "last_item_start_us": avg(last)}


def step_profile_merge(T):
    rows = []
    for rep in range(1, STEP_REPEATS + 1):
        for v, params, env, _ in STEP_VARIANTS:
            tag = f"{v}_{rep}"
            prof = lfps_profile_lines(f"{T}/{tag}.log")
            rs = jload(f"{T}/{tag}.sdpa.json")["rows"]
            for i, r in enumerate(rs):
                row = {"call": f"repeat {rep}", "variant": v, "params": params, "context": r["context"]}
                if env:
                    row["pool_warm_us"] = 500
                row.update(ms_per_token_step=r.get("ms_per_token_step"),
                           sdpa_ms_per_token_step=r.get("sdpa_ms_per_token_step"), ratio=r.get("ratio"),
                           lfps_us_per_select=prof[i] if len(prof) == len(rs) else None)
                row.update(trace_step_fields(f"{T}/{tag}_lfps_{r['context']}_b1.json"))
                rows.append(row)
    return {"bench": "kvferry-e2e --modes lfps (32 layers, Llama-3.1-8B attention shape, batch 1, lfps@2% route "
                     "auto) with the lfps parameter profile=1 and --trace",
            "device": "one GPU of the lent machine + its cores (provenance.gpu / provenance.cpu)",
            "scripts": step_profile_cmds(T),
            "note": "lfps_us_per_select: LfpsPolicy phase profile, microseconds per Select (one KV head of one layer), "
                    "averaged over the row (warm-up and timed steps). The trace fields come from the one traced step "
                    "after the timed ones: select_us_per_layer is the host select stage of a layer, slowest_item_us / "
                    "mean_item_us the (sequence, KV head) pool tasks (cpu_item), last_item_start_us when the last of "
                    "them started after the stage began. pool_warm500: RuntimeConfig::cpu_spin_us = 500 (--cpu-spin-us 500, CpuPool::KeepWarm). "
                    f"{STEP_REPEATS} interleaved repeats of every variant: the spread between repeats is the noise.",
            "rows": rows, "regenerate": "python3 bench/reproduce.py lfps_step_profile"}


# prhs_etf_smollm2: PrHS's early-token freezing at prefill, off / projected (default) / copy_kv.
ETF_RUNS = (("off", ""), ("projected (default)", "--etf"), ("copy_kv", "--etf-copy-kv"))


def etf_tag(name):
    return name.split()[0]


def prhs_etf_cmds(T):
    base = f"{HOST_PPL} --text data/kjv.txt --context 8192 --scored 1024 --policy sparcas --budget 256"
    return [FETCH] + [f"{base} {flag} --json {T}/etf_{etf_tag(n)}.json".replace("  ", " ") for n, flag in ETF_RUNS]


def prhs_etf_merge(T):
    rows, params, off = [], {}, {}
    for name, _ in ETF_RUNS:
        f = f"{T}/etf_{etf_tag(name)}.json"
        d = jload(f)
        etf = d.get("etf") or {}
        if etf:
            params = {"psi": etf["psi"], "gamma": etf["gamma"], "start": f"floor(3N/4) = {etf['start']} of 30",
                      "sink": etf["sink"]}
        for l in d["lanes"]:
            if name == "off":
                off[l["lane"]] = l["perplexity"]
            rows.append({"etf": name, "lane": l["lane"], "perplexity": l["perplexity"],
                         "frozen_row_fraction": etf.get("frozen_row_fraction", 0.0), "source": os.path.basename(f),
                         "ppl_change_pct": 100.0 * (l["perplexity"] / off[l["lane"]] - 1) if off.get(l["lane"]) else 0.0})
    return {"bench": "PrHS ETF (early-token freezing at prefill) in examples/llama: SmolLM2-135M-Instruct Q4_1, "
                     "data/kjv.txt from line 0, 8192-token window, last 1024 tokens scored (decode unchanged), host "
                     "backend; off, the hidden-state pass-through (--etf, the default) and App. D's K/V copy from the "
                     "layer below (--etf-copy-kv), each with dense and sparcas@256 lanes",
            "params": params, "commands": prhs_etf_cmds("OUT")[1:], "rows": rows,
            "note": "ppl_change_pct: against the same lane with ETF off, same run. --etf-copy-kv stores a frozen "
                    "row's K/V from the layer below (another layer's key space); --etf projects each layer's K/V "
                    "from the frozen row's hidden state (docs/prhs.md).",
            "regenerate": "python3 bench/reproduce.py prhs_etf_smollm2"}


# prhs_lfps_quality_smollm2: PrHS's wrappers around lfps, one kvferry-llama run.
def prhs_lfps_cmds(T):
    return [FETCH, f"{HOST_PPL} --text data/kjv.txt --offset-lines 1000 --context 4096 --scored 1024 "
                   f"--policy oracle,lfps,cis+lfps,psaw+lfps,xl+lfps --budget 256 --json {T}/out.json"]


def prhs_lfps_merge(T):
    d = jload(f"{T}/out.json")
    d["what"] = ("PrHS's wrappers around lfps on real attention: SmolLM2-135M-Instruct Q4_1 on the KJV (from line "
                 "1000), 4096-token window, last 1024 tokens scored, budget 256, host backend (the planned CPU step "
                 "with the host scan), one binary, one run. Command: " + prhs_lfps_cmds("OUT")[1])
    d["regenerate"] = "python3 bench/reproduce.py prhs_lfps_quality_smollm2"
    return d


# prhs_rho_smollm2: CIS's reuse ratio on a 2K trace (kvferry-bench replay) and three perplexity runs.
RHO_CIS = [(8, 0.7, 1), (8, 0.8, 1), (8, 0.9, 1), (16, 0.7, 1), (16, 0.8, 1), (16, 0.9, 1),
           (8, 0.7, 0), (8, 0.8, 0), (8, 0.9, 0), (16, -1.0, 0), (16, 0.7, 0), (16, 0.8, 0), (16, 0.9, 0)]
RHO_PPL_CIS = [(16, 0.8, 0), (16, 0.7, 1)]


def cis_params(s, tau, gm):
    return f"--param cis.s={s} --param cis.tau={tau:g} --param cis.group_mean={gm}"


def cis_tag(s, tau, gm):
    return f"s{s}_tau{tau:g}_{'mean' if gm else 'min'}"


def prhs_rho_cmds(T):
    tr = f"{T}/kjv2k.safetensors"
    rep = f"{BENCH} --trace {tr} --budget 128 --sink 8 --window 32 --context 1792 --steps 256 --backend host"
    ppl = f"{HOST_PPL} --text data/kjv.txt --offset-lines 1000 --context 2048 --scored 256 --budget 128 --sinks 8 --window 32"
    cmds = [FETCH, trace_cmd(tr, "data/kjv.txt", 1000, 2048, dtype="bf16")]
    cmds += [f"{rep} --policy cis+oracle {cis_params(*c)} --json {T}/rep_{cis_tag(*c)}.json" for c in RHO_CIS]
    cmds += [f"{rep} --policy {p} --json {T}/rep_{p}.json" for p in ("oracle", "streaming")]
    cmds += [f"{ppl} --policy oracle,streaming --json {T}/ppl_base.json"]
    cmds += [f"{ppl} --policy cis+oracle --no-dense {cis_params(*c)} --json {T}/ppl_{cis_tag(*c)}.json"
             for c in RHO_PPL_CIS]
    return cmds


def rho_of(stats):
    n, r = stats.get("select_calls", 0), stats.get("select_reused", 0)
    return (round(n / (n + r), 4) if n + r else None), n, r


def prhs_rho_merge(T):
    rows = []
    for s, tau, gm in RHO_CIS:
        d = jload(f"{T}/rep_{cis_tag(s, tau, gm)}.json")
        rho, n, r = rho_of(d.get("stats") or {})
        rows.append({"policy": "cis+oracle", "s": s, "tau": tau, "group_gate": "mean" if gm else "min", "rho": rho,
                     "select_calls": n, "select_reused": r, "recall": d["recall"],
                     "mass_recall": d["mass_recall"], "rel_err": d["rel_err"]})
    for p in ("oracle", "streaming"):
        d = jload(f"{T}/rep_{p}.json")
        rows.append({"policy": p, "recall": d["recall"], "mass_recall": d["mass_recall"], "rel_err": d["rel_err"]})
    lanes = [{"lane": l["lane"], "perplexity": l["perplexity"]} for l in jload(f"{T}/ppl_base.json")["lanes"]]
    for s, tau, gm in RHO_PPL_CIS:
        for l in jload(f"{T}/ppl_{cis_tag(s, tau, gm)}.json")["lanes"]:
            lanes.append({"lane": l["lane"], "perplexity": l["perplexity"],
                          "params": {"cis.s": s, "cis.tau": tau, "cis.group_mean": gm},
                          "rho": rho_of(l.get("stats") or {})[0]})
    floor_ok = all(r["rho"] is None or r["rho"] >= 1.0 / r["s"] - 1e-9 for r in rows if "s" in r)
    c = prhs_rho_cmds("T")
    return {"what": "CIS (cis+oracle) reuse ratio rho = base Select calls / (calls + reused) on a real SmolLM2-135M "
                    "trace, next to the paper's figures",
            "trace": "kvferry-llama --dump-trace of SmolLM2-135M-Instruct Q4_1 on data/kjv.txt --offset-lines 1000, "
                     "2048 positions, all 30 layers, post-RoPE q/k/v in bf16 (9 query heads, 3 KV heads, head_dim 64)",
            "replay": "kvferry-bench --trace ... --budget 128 --sink 8 --window 32 --context 1792 --steps 256 --backend "
                      "host (the paper's GSM8K budget: 128 = 8 sink + 32 local + 88 chosen); 256 steps x 30 layers x 3 "
                      "KV heads = 23040 selections per row",
            "recall": "bench's recall: fraction of the exact top-k (oracle) of the chosen (non-resident) positions that "
                      "the selection holds; mass_recall: attention mass of the selection over all positions; rel_err: "
                      "relative L2 error of the attention output vs dense (mean over steps)",
            "paper": {"tau_0.8_s_8_rho": "about 0.15-0.18 (Table II: .164 L2-7B, .183 L3-70B, .194 Mistral-7B)",
                      "tau_0.8_s_16_rho": "about 0.08-0.09 (.087, .082, .088)",
                      "table_VI": {"s4_tau0.8": 0.301, "s8_tau0.7": 0.152, "s8_tau0.8_r2": 0.184, "s32_tau0.8": 0.0046},
                      "model": "LLaMA2-7B-Chat (MHA), LLaMA3-70B and Mistral-7B (GQA), GSM8K/CoQA generation"},
            "rows": rows,
            "perplexity": {"command": c[-3].replace(" --policy oracle,streaming", "").rsplit(" --json", 1)[0] +
                                      " (one run for dense, oracle, streaming; one per cis lane with its --param)",
                           "lanes": lanes},
            "notes": [f"rho >= 1/s {'holds in every row' if floor_ok else 'fails in some row'}; tau = -1 shares every "
                      "non-first step of a block (rho = 1/s).",
                      "The group gate matters under GQA: 'min' needs all 3 query heads of a KV head above tau, "
                      "'mean' their mean.",
                      "The steps replayed are teacher-forced text rows of the prompt (the trace's prefill queries), "
                      "not generated answer tokens as in the paper's GSM8K/CoQA runs.",
                      "rho, recall and errors are deterministic functions of the trace (timings are not reported)."],
            "regenerate": "python3 bench/reproduce.py prhs_rho_smollm2"}


# kvpop_mass_smollm2: KVpop's untrained attention-mass scorer (scorer=2): its decay swept at 256,
# the default at 256 / 512, passkey, a trace replay, and a held-out text; dense / oracle /
# streaming in the same run.
KVPOP_SWEEP = (0.999999, 0.9999, 0.9995, 0.999, 0.998, 0.995)
KVPOP2 = "--policy kvpop --param scorer=2"


# hip_quality_smollm2 / hip_kvpop_replay_smollm2: where HiP's and KVpop's quality goes and what
# HiP's recall guard gives back (docs/policies.md, "hip"): SmolLM2, KJV and the Jargon File from
# line 0, 8192-token windows, last 1024 scored; both texts run side by side (one core each).
HQ_TEXTS = ("kjv", "jargon")
HIP_GUARD = "--param guard=0.9 --param over=4"


def side_by_side(*cmds):
    """Commands run in parallel; the line fails when one of them does."""
    body = " ".join(f"( {c} ) & p{i}=$!;" for i, c in enumerate(cmds))
    return body + " " + " && ".join(f"wait $p{i}" for i in range(len(cmds)))


def hip_quality_cmds(T):
    def text_cmds(t):
        base = f"{HOST_PPL} --text data/{t}.txt --context 8192 --scored 1024 --cpu-threads 1"
        return " && ".join([
            f"{base} --policy streaming,oracle,hip --budget 256,512 --json {T}/{t}_base.json",
            f"{base} --policy hip {HIP_GUARD} --budget 256,512 --no-dense --json {T}/{t}_guard.json",
            f"{base} --policy hip {HIP_GUARD} --param fresh=0 --budget 256,512 --no-dense --json {T}/{t}_cached.json"])
    pk = (f"{LLAMA} --model {MODEL} --passkey --text data/kjv.txt --backend host --cpu-threads 1 "
          f"--lengths 2048,4096,8192 --depths 0.1,0.5,0.9 --budget 256")
    return [FETCH, side_by_side(*(text_cmds(t) for t in HQ_TEXTS)),
            side_by_side(f"{pk} --policy oracle,hip --json {T}/passkey.json",
                         f"{pk} --policy hip {HIP_GUARD} --no-dense --json {T}/passkey_guard.json")]


def passkey_found(path, key=lambda lab: lab, found=None):
    """kvferry-llama --passkey --json: {lane label (renamed by key): found, trials, by_prompt},
    added to \p found when given."""
    found = {} if found is None else found
    for tr in jload(path)["trials"]:
        for lab, a in tr["answers"].items():
            f = found.setdefault(key(lab), {"found": 0, "trials": 0, "by_prompt": []})
            f["found"] += int(a["found"])
            f["trials"] += 1
            f["by_prompt"].append({"length": tr["length"], "depth": tr["depth"], "found": a["found"]})
    return found


def attach_passkey(rows, found, text="data/kjv.txt"):
    """Each row of the passkey's text whose label has a tally gets it as "passkey"."""
    for r in rows:
        if r["text"] == text and r["label"] in found:
            r["passkey"] = found[r["label"]]


def hip_quality_merge(T):
    rows = []
    tags = {"base": {}, "guard": {"guard": 0.9, "over": 4}, "cached": {"guard": 0.9, "over": 4, "fresh": 0}}
    for t in HQ_TEXTS:
        lanes = {}
        for part, params in tags.items():
            for lab, l in lanes_of(f"{T}/{t}_{part}.json").items():
                key = lab if part == "base" else lab.replace("hip", f"hip_{part}", 1)
                lanes[key] = {"policy": l["lane"].split("@")[0], "params": params if part != "base" else {},
                              "budget": l.get("budget"), "perplexity": l["perplexity"],
                              "decode_seconds": l["decode_seconds"]}
                st = l.get("stats", {})
                ranked, reused = st.get("select_calls", 0), st.get("select_reused", 0)
                if key.startswith("hip") and ranked + reused > 0:  # HiP's counters (HipPolicy::counters)
                    lanes[key]["ranked_share"] = round(ranked / (ranked + reused), 4)
        gaps(lanes)
        for lab, r in lanes.items():
            rows.append({"label": lab, "text": f"data/{t}.txt", "context": 8192, "scored": 1024, **r})
    found = passkey_found(f"{T}/passkey.json")
    passkey_found(f"{T}/passkey_guard.json", lambda lab: lab.replace("hip", "hip_guard", 1), found)
    attach_passkey(rows, found)
    return {"what": "HiP's perplexity and passkey with its defaults and its recall guard (guard=0.9 over=4; "
                    "a head the guard finds short ranked at every step, fresh=1, the default, or its last "
                    "rebuild's ranking cached, fresh=0), next to dense, streaming and the oracle; SmolLM2-135M, "
                    "host backend, sinks 4 + window 64",
            "regenerate": "python3 bench/reproduce.py hip_quality_smollm2",
            "passkey": "KJV, lengths 2048/4096/8192, depths 0.1/0.5/0.9, budget 256, greedy answer",
            "rows": rows}


def hip_passkey_cmd(T, lanes):
    """Passkey on KJV at 256 (2K/4K/8K x 3 depths) for the oracle and \p lanes, decoding together."""
    return (f"{LLAMA} --model {MODEL} --passkey --text data/kjv.txt --backend host --cpu-threads 2 --lanes-together "
            f"--lengths 2048,4096,8192 --depths 0.1,0.5,0.9 --budget 256 --policy oracle,{','.join(lanes)} "
            f"--json {T}/passkey.json")


SMOLLM2_LAYERS, HIP_DENSE_LAYERS = 30, 3  # SmolLM2-135M's layers; HiP's default dense_layers
# HiP's mask cadence defaults (policies/hip/hip.h's HipParams), written on each hip row as
# "hip_defaults": what its lane's "defaults" meant when it ran (scripts/docs_tables.py).
HIP_DEFAULTS = {"r_m": 8, "drift": 0.7, "lag": 0}


def hip_lane_rows(path, text, context):
    """A perplexity run of lanes "policy[:k=v...]@budget" (kvferry-llama --json) as rows with their
    parameters and gaps; a hip lane whose stats count its selections (the host-selecting path) also
    gets mask_builds: the share of the mask layers' head-steps that built or requested a mask."""
    lanes = {}
    for lab, l in lanes_of(path).items():
        name, *kv = l["policy"].split(":")  # a lane "hip:r_m=1:lag=0" carries its parameters
        params = {k: int(float(v)) if float(v).is_integer() else float(v) for k, v in (x.split("=") for x in kv)}
        row = {"policy": name, "params": params, "budget": l.get("budget"), "perplexity": l["perplexity"],
               "decode_seconds": l.get("decode_seconds"), **({"hip_defaults": HIP_DEFAULTS} if name == "hip" else {})}
        st = l.get("stats") or {}
        calls, reused = st.get("select_calls", 0), st.get("select_reused", 0)
        if name == "hip" and calls + reused:  # calls: the dense layers' head-steps and the builds
            dense = params.get("dense_layers", HIP_DENSE_LAYERS)
            row["mask_builds"] = round((calls / (calls + reused) * SMOLLM2_LAYERS - dense) /
                                       (SMOLLM2_LAYERS - dense), 4)
        lanes[lab] = row
    gaps(lanes)
    return [{"label": lab, "text": text, "context": context, "scored": 1024, **r} for lab, r in lanes.items()]


# hip_drift_smollm2: HiP's mask rebuilt when the query moves (drift d: a ranked step whose query's
# int8 codes fall below cosine d of the build query's in any head) and served at once (lag 0; the
# default, d = 0.7, and d = 0.8), against the paper's cadence (every 8 steps, a step late), every
# step at once, streaming and the oracle, on KJV and the Jargon File (8K) and on the
# GPL-3 text every Debian system carries (4K, a text no default was chosen on). The host-selecting
# path (--bank-slots 16) so that each lane's stats count its mask builds: select_calls over
# calls + reused, less the 3 dense layers of 30. hip:align=0: the paper's even first nodes in place of
# the default's power-of-two-aligned ones, at the default's cadence.
HIP_DRIFT = ("hip:drift=0:lag=1", "hip", "hip:drift=0.8", "hip:r_m=1", "hip:align=0")
HIP_DRIFT_BUDGETS = (256, 512, 1024, 2048)
UNSEEN_TEXT = "/usr/share/common-licenses/GPL-3"
# The quality texts of the SmolLM2 perplexity runs: KJV and the Jargon File at 8K, and GPL-3 at 4K.
QUALITY_TEXTS = (("kjv", "data/kjv.txt", 8192), ("jargon", "data/jargon.txt", 8192), ("gpl3", UNSEEN_TEXT, 4096))


def quality_texts_cmds(T, lanes, budgets="256", unseen_budgets=None):
    """Host-backend perplexity of kvferry-llama's \p lanes (its --policy and lane options) on the
    QUALITY_TEXTS, last 1024 scored: KJV and Jargon side by side (a core each), then GPL-3 on both
    cores; one JSON per text under T."""
    run = lambda path, ctx, threads, b, out: (f"{HOST_PPL} --text {path} --context {ctx} --scored 1024 "
                                              f"--cpu-threads {threads} {lanes} --budget {b} --json {T}/{out}.json")
    (t0, p0, c0), (t1, p1, c1), (t2, p2, c2) = QUALITY_TEXTS
    return [FETCH, side_by_side(run(p0, c0, 1, budgets, t0), run(p1, c1, 1, budgets, t1)),
            run(p2, c2, 2, unseen_budgets or budgets, t2)]


def quality_texts_rows(T):
    """The rows of quality_texts_cmds' run (hip_lane_rows of each text's JSON)."""
    return [r for t, path, ctx in QUALITY_TEXTS for r in hip_lane_rows(f"{T}/{t}.json", path, ctx)]


def hip_drift_cmds(T):
    lanes = f"--policy streaming,oracle,{','.join(HIP_DRIFT)} --lanes-together --bank-slots 16"
    return quality_texts_cmds(T, lanes, ",".join(map(str, HIP_DRIFT_BUDGETS)), "256,512") + \
        [hip_passkey_cmd(T, HIP_DRIFT)]


def hip_drift_merge(T):
    rows = quality_texts_rows(T)
    attach_passkey(rows, passkey_found(f"{T}/passkey.json"))
    return {"what": "HiP's perplexity gap to dense with its mask rebuilt when the query drifts (cosine of the int8 "
                    "codes below 0.7, the default, or 0.8 in any head, served at once), every 8 steps a step late "
                    "(the paper's cadence) and every step at once, next to streaming and the oracle at the same budgets; SmolLM2-135M, "
                    "host backend selecting on the host (bank 16 slots), sinks 4 + window 64, last 1024 scored of "
                    "8K (KJV, Jargon) and of 4K (GPL-3, a text no default was chosen on); hip:align=0: the paper's even "
                    "first nodes at the default's cadence; mask_builds: the share of the mask layers' head-steps "
                    "that built a mask",
            "regenerate": "python3 bench/reproduce.py hip_drift_smollm2",
            "passkey": "KJV, lengths 2048/4096/8192, depths 0.1/0.5/0.9, budget 256, greedy answer",
            "rows": rows}


# hip_speed: hip_bank's decode step at 128K, batch 1 and 4, with the real (moving) query, for the
# mask rebuilds hip_drift_smollm2 measures the quality of: the default (when the query turns,
# served at once), the paper's cadence (every 8 steps, a step late, built on the side stream),
# every step, and the paper's even first nodes (align=0, whose rebuilt masks move every block);
# torch SDPA with every layer's KV on the GPU in the same run.
HIP_SPEED = (("default", ""), ("clock_lag1", "--param drift=0 --param lag=1"), ("r_m1", "--param r_m=1"),
             ("align0", "--param align=0"))


def hip_speed_cmds(T):
    base = f"{E2E} --unique-kv --steps 8 --query real --contexts 131072 --batches 1,4 --modes hip_bank"
    return [f"{base} {extra} --json {T}/{v}.jsonl" for v, extra in HIP_SPEED] + [sdpa_pending(T)]


def hip_speed_merge(T):
    rows = []
    for v, extra in HIP_SPEED:
        params = dict(x.split("=") for x in extra.replace("--param ", "").split())
        for r in jload(f"{T}/{v}.sdpa.json").get("rows", []):
            rows.append({"variant": v, "params": {k: float(x) for k, x in params.items()}, "hip_defaults": HIP_DEFAULTS,
                         **r})
    label_query(rows)
    return {"what": "hip_bank's decode step per token at 128K x 1 and x 4 (Llama-3.1-8B shape, 32 layers, real "
                    "moving query) for HiP's mask rebuild variants, ratio to torch SDPA with all KV on the GPU in "
                    "the same run",
            "bench": "kvferry-e2e (bench/e2e_bench.cu) + scripts/device/e2e_sdpa.py",
            "regenerate": "python3 bench/reproduce.py hip_speed",
            "rows": rows}


# sparcas_refresh: SparCas re-chooses its dimensions every u ranked steps and then re-gathers every
# offloaded key's compact row (over PCIe from the host store), so its steady-state step is only seen
# over more than u steps: sparcas_bank at 128K x 1 and x 4 over 130 steps (two refreshes at the
# default u = 64) for u = 64, 256 and never (2^20), torch SDPA in the same run.
# sparcas_refresh_smollm2 is the quality side: the same u on SmolLM2 next to the oracle.
SPARCAS_U = (64, 256, 1024, 1 << 20)


def sparcas_refresh_cmds(T):
    base = f"{E2E} --unique-kv --steps 130 --query real --contexts 131072 --batches 1,4 --modes sparcas_bank"
    return [f"{base} --param u={u} --json {T}/u{u}.jsonl" for u in SPARCAS_U if u != 1024] + [sdpa_pending(T)]


def sparcas_refresh_merge(T):
    rows = []
    for u in SPARCAS_U:
        if u == 1024:
            continue
        for r in jload(f"{T}/u{u}.sdpa.json").get("rows", []):
            rows.append({**r, "variant": f"u{u}", "params": {"u": u}})
    label_query(rows)
    return {"what": "sparcas_bank's decode step per token at 128K x 1 and x 4 (Llama-3.1-8B shape, 32 layers, real "
                    "moving query) over 130 steps for SparCas's dimension refresh every u = 64, 256 (the default) "
                    "and 2^20 (never) ranked steps; ratio to torch SDPA with all KV on the GPU in the same run",
            "bench": "kvferry-e2e (bench/e2e_bench.cu) + scripts/device/e2e_sdpa.py",
            "regenerate": "python3 bench/reproduce.py sparcas_refresh",
            "rows": rows}


def sparcas_refresh_quality_cmds(T):
    lanes = ",".join(["streaming", "oracle"] + [f"sparcas:u={u}" for u in SPARCAS_U])
    return quality_texts_cmds(T, f"--policy {lanes} --lanes-together")


def sparcas_refresh_quality_merge(T):
    return {"what": "SparCas's perplexity gap to dense with its dimensions re-chosen every u = 64, 256 (the "
                    "default), 1024 and 2^20 (never) ranked steps, next to streaming and the oracle at budget 256; "
                    "SmolLM2-135M, host backend, sinks 4 + window 64, last 1024 scored of 8K (KJV, Jargon) and of "
                    "4K (GPL-3, a text no default was chosen on)",
            "regenerate": "python3 bench/reproduce.py sparcas_refresh_smollm2",
            "rows": quality_texts_rows(T)}


# kernel_profile: where each device policy's decode step goes, kernel by kernel (ncu, steady state after
# 24 token steps, 128K x 1, real query), with the HBM rate measured in the same run and the bank
# misses' rate over the step kernel against the PCIe rate measured at Create.
PROFILE_MODES = ("sparcas_bank", "quest_bank", "hip_bank", "kvpop_bank")


def kernel_profile_cmds(T):
    return [f"{PY} bench/kernel_profile.py --e2e {E2E} --mode {m} --context 131072 --batch 1 --json {T}/{m}.json"
            for m in PROFILE_MODES]


def kernel_profile_merge(T):
    rows = [jload(f"{T}/{m}.json") for m in PROFILE_MODES if os.path.exists(f"{T}/{m}.json")]
    return {"what": "each device policy's decode layer kernel by kernel at 128K x 1 (32 layers of the Llama-3.1-8B "
                    "shape, real query, token bank on), steady state after 24 token steps: duration, DRAM bytes, "
                    "their rate against the HBM rate measured in the same run; the bank misses' bytes over the "
                    "step kernel's time against the PCIe rate kvferry measured at Create. ncu serialises the "
                    "kernels: a layer's sum has no launch gaps (the e2e row beside it has the step's time)",
            "bench": "bench/kernel_profile.py (ncu over kvferry-e2e)",
            "regenerate": "python3 bench/reproduce.py kernel_profile",
            "rows": rows}


# knorm_smollm2: the key-norm policy (policies/knorm: the offloaded keys of smallest L2 norm, no
# query read) next to streaming and the oracle at budget 256, on KJV and the Jargon File (8K) and
# on GPL-3 (4K, a text no default was chosen on).
def knorm_quality_cmds(T):
    return quality_texts_cmds(T, "--policy streaming,oracle,knorm --lanes-together")


def knorm_quality_merge(T):
    return {"what": "knorm's perplexity gap to dense (the offloaded keys of smallest L2 norm) next to streaming and "
                    "the oracle at budget 256; SmolLM2-135M, host backend, sinks 4 + window 64, last 1024 scored "
                    "of 8K (KJV, Jargon) and of 4K (GPL-3)",
            "regenerate": "python3 bench/reproduce.py knorm_smollm2",
            "rows": quality_texts_rows(T)}


REPLAY_LANES = ("oracle@256 streaming@256 quest@256 sparcas@256 lfps@256 hip@256 "
                "hip_paper=hip@256:bits=16,align=0 hip_fresh=hip@256:r_m=1,lag=0 "
                "hip_dl11=hip@256:dense_layers=11 hip_guard=hip@256:guard=0.9,over=4,fresh=0 "
                "kvpop@256 kvpop_s2=kvpop@256:scorer=2 kvpop_s2_g9995=kvpop@256:scorer=2,gamma=0.9995 "
                "oracle@2048 streaming@2048 kvpop@2048 kvpop_s2@2048=kvpop@2048:scorer=2")


def replay_cmds(T):
    lanes = " ".join(f"--lane {l}" for l in REPLAY_LANES.split())
    W = "--policy-weights policies/weights/kvpop_smollm2.safetensors"
    return [FETCH, side_by_side(*(trace_cmd(f"{T}/{t}8k.safetensors", f"data/{t}.txt", 0, 8192, dtype="bf16")
                                  + " --cpu-threads 1" for t in HQ_TEXTS)),
            *[f"{B}/bench/select_replay_bench {W} --trace {T}/{t}8k.safetensors --from 7680 --threads 2 "
              f"--detail hip@256 {lanes} --json {T}/{t}.json" for t in HQ_TEXTS]]


def replay_merge(T):
    texts = {}
    for t in HQ_TEXTS:
        d = jload(f"{T}/{t}.json")
        d["trace"] = f"data/{t}.txt from line 0, 8192 tokens, every layer (kvferry-llama --dump-trace)"
        texts[t] = d
    return {"what": "every lane's selection replayed teacher-forced over the last 512 positions of an 8K SmolLM2 "
                    "trace: recall of the exact top-k, attention mass kept, output error and turnover, per layer",
            "regenerate": "python3 bench/reproduce.py hip_kvpop_replay_smollm2",
            "rows": [{"text": t, **{k: v for k, v in d.items() if k != "lanes"}, "lanes": d["lanes"]}
                     for t, d in texts.items()]}


def kvpop_mass_cmds(T):
    kjv = f"{HOST_PPL} --text data/kjv.txt --context 8192 --scored 1024"
    jar = f"{HOST_PPL} --text data/jargon.txt --context 8192 --scored 1024"
    cmds = [FETCH, f"{kjv} --policy oracle,streaming --budget 256,512 --json {T}/kjv_base.json",
            f"{kjv} {KVPOP2} --budget 256,512 --no-dense --json {T}/kjv_default.json"]
    cmds += [f"{kjv} {KVPOP2} --param gamma={g} --budget {'256,512' if g == 0.9995 else 256} --no-dense "
             f"--json {T}/kjv_gamma{g}.json" for g in KVPOP_SWEEP]
    cmds += [f"{LLAMA} --model {MODEL} --passkey --text data/kjv.txt --backend host --lengths 2048,4096 "
             f"--depths 0.1,0.5,0.9 {KVPOP2} --budget 256 --json {T}/passkey.json",
             trace_cmd(f"{T}/kjv4k.safetensors", "data/kjv.txt", 1000, 4096),
             f"{BENCH} --trace {T}/kjv4k.safetensors {KVPOP2} --budget 256 --steps 64 --sink 4 --window 64 "
             f"--kv-dtype f16 --backend host --json {T}/replay.json",
             f"{jar} --policy oracle,streaming --budget 256 --json {T}/jargon_base.json"]
    cmds += [f"{jar} {KVPOP2} --param gamma={g} --budget 256 --no-dense --json {T}/jargon_gamma{g}.json"
             for g in (0.998, 0.9995)]
    return cmds


def kvpop_mass_merge(T):
    base = lanes_of(f"{T}/kjv_base.json")

    def row(lane, gamma, set_by, seconds=False):
        lanes = gaps({**{k: dict(v) for k, v in base.items()}, lane["lane"]: dict(lane)})
        r = lanes[lane["lane"]]
        out = {"gamma": gamma, "set_by": set_by, "budget": lane["budget"], "perplexity": lane["perplexity"]}
        if seconds:
            out["decode_seconds"] = lane["decode_seconds"]
        out.update(gap_pct=r.get("gap_pct"), gap_over_oracle_gap=r.get("gap_over_oracle_gap"))
        return out
    sweep = [row(l, g, "the 'gamma' parameter") for g in KVPOP_SWEEP
             for l in jload(f"{T}/kjv_gamma{g}.json")["lanes"]]
    default = [row(l, 0.998, "the default 'gamma'", True) for l in jload(f"{T}/kjv_default.json")["lanes"]]
    pk = jload(f"{T}/passkey.json")
    found = {}
    for t in pk["trials"]:
        for lab, a in t["answers"].items():
            found[lab] = found.get(lab, 0) + int(a["found"])
    rep = jload(f"{T}/replay.json")
    jb = lanes_of(f"{T}/jargon_base.json")
    jk = {g: jload(f"{T}/jargon_gamma{g}.json")["lanes"][0]["perplexity"] for g in (0.998, 0.9995)}
    held = {"text": "data/jargon.txt from line 0, 8192-token window, last 1024 scored, budget 256 (same command, "
                    "--text data/jargon.txt)",
            "dense": jb["dense"]["perplexity"], "oracle@256": jb["oracle@256"]["perplexity"],
            "streaming@256": jb["streaming@256"]["perplexity"],
            "kvpop_scorer2_gamma0.998": jk[0.998], "kvpop_scorer2_gamma0.9995": jk[0.9995]}
    held["finding"] = (f"scorer 2 at gamma 0.998: {jk[0.998]:.3f} ({jk[0.9995]:.3f} at 0.9995) against streaming "
                       f"{held['streaming@256']:.3f}, dense {held['dense']:.3f}, oracle {held['oracle@256']:.3f}: "
                       + ("worse than pure recency on this text" if jk[0.998] > held["streaming@256"]
                          else "better than pure recency on this text"))
    return {"bench": "kvpop_mass_smollm2",
            "notes": ["KVpop scorer 2 (policies/kvpop/kvpop.h): r_u = log(1e-6 + max_g A_g(u) / window), A_g(u) = head g's "
                      "softmax weight of u over the sinks and window of each query while u is in the window, summed "
                      "over those window queries; static priority p = r - u log gamma; no training. Host backend, "
                      "kvferry-llama --perplexity, SmolLM2-135M-Instruct Q4_1, data/kjv.txt from line 0, 8192-token "
                      "window, last 1024 scored, sinks 4, window 64, --no-dense; dense, oracle and streaming in the "
                      "same run (kjv_base).",
                      "The decay is chosen on this text (the sweep at budget 256); held_out_jargon_8k_256 is the "
                      "check on a second text.",
                      "Passkey: 2K / 4K x depths 0.1 / 0.5 / 0.9, budget 256, dense in the same run."],
            "command": kvpop_mass_cmds("OUT")[2].replace("--json OUT/kjv_default.json", "[--param gamma=G] --json F"),
            "sweep_budget_256": sweep, "default": default,
            "passkey": {"found": found, "trials": len(pk["trials"]), "raw": "passkey.json"},
            "trace_replay_256": {k: rep[k] for k in ("recall", "mass_recall", "rel_err", "rel_err_max", "steps",
                                                     "layers", "context", "workload") if k in rep},
            "held_out_jargon_8k_256": held, "regenerate": "python3 bench/reproduce.py kvpop_mass_smollm2"}


# kvpop_train_smollm2: scripts/kvpop_train.py on four texts (KJV from line 20000 and the Jargon File
# from line 2000, 8K each: windows no quality run scores; the GFDL 1.3 and MPL 2.0 texts every
# Debian system carries, 4K and 3.5K), validated on GPL-3 (4K, a text it never trains on). The
# weights go to $T, not over policies/weights/kvpop_smollm2.safetensors (kvpop_decay_smollm2 then
# chooses their decays).
KVPOP_TRAIN = (("train_kjv", "data/kjv.txt", 20000, 8191), ("train_jargon", "data/jargon.txt", 2000, 8191),
               ("train_gfdl", "/usr/share/common-licenses/GFDL-1.3", 0, 4096),
               ("train_mpl", "/usr/share/common-licenses/MPL-2.0", 0, 3584))


def kvpop_train_cmds(T):
    return [FETCH,
            *[trace_cmd(f"{T}/{n}.safetensors", path, off, ctx) for n, path, off, ctx in KVPOP_TRAIN],
            trace_cmd(f"{T}/val_gpl3.safetensors", UNSEEN_TEXT, 0, 4096),
            f"{PY} scripts/kvpop_train.py --train {' '.join(f'{T}/{n}.safetensors' for n, *_ in KVPOP_TRAIN)} "
            f"--val {T}/val_gpl3.safetensors --out {T}/kvpop_smollm2.safetensors --report {T}/out.json "
            f"--sink 4 --window 64 --ks 188 444 --hidden 16 --steps 400 --batch 128 --threads 2 --seed 0 "
            f"--log-every 20"]


def kvpop_train_merge(T):
    d = jload(f"{T}/out.json")
    d["regenerate"] = "python3 bench/reproduce.py kvpop_train_smollm2"
    return d


# kvpop_decay_smollm2: KVpop's decay per group of layers chosen by decoding
# (scripts/kvpop_decay_search.py) for the committed scorer, on training windows of KJV (line 20000)
# and the Jargon File (line 2000) that the quality runs do not score; then, in the same run, the
# chosen decays against the same scorer at the paper's decay (alpha 0 over [0.999, 0.999999]),
# streaming and the oracle, at 256-2048 of 8K on KJV and the Jargon File (line 0: the windows every
# quality table scores) and at 256/512 of 4K of GPL-3 (a text neither the scorer nor its decays
# saw), passkey at 256. As many processes at a time as the machine has cores. The weights go to $T;
# policies/weights/kvpop_smollm2.safetensors is the output of the committed run.
KVPOP_W = "policies/weights/kvpop_smollm2.safetensors"
KVPOP_TRAIN_TEXTS = "data/kjv.txt:20000 data/jargon.txt:2000"
KVPOP_GROUPS = "0-2 3-10 11-19 20-29"
KVPOP_Q = (("kjv", "data/kjv.txt", 8192, (256, 512, 1024, 2048)),
           ("jargon", "data/jargon.txt", 8192, (256, 512, 1024, 2048)),
           ("gpl3", UNSEEN_TEXT, 4096, (256, 512)))


def kvpop_decay_cmds(T):
    W, P = f"{T}/kvpop_smollm2.safetensors", f"{T}/kvpop_paper.safetensors"
    runs = []
    for t, path, ctx, budgets in KVPOP_Q:
        base = f"{HOST_PPL} --text {path} --context {ctx} --scored 1024 --cpu-threads 1"
        for b in budgets:
            dense = "" if b == budgets[0] else " --no-dense"
            runs.append(f"{base} --policy-weights {W} --policy streaming,oracle,kvpop --budget {b} "
                        f"--lanes-together{dense} --json {T}/{t}_{b}.json")
            runs.append(f"{base} --policy-weights {P} --policy kvpop --budget {b} --no-dense --json {T}/{t}_{b}_paper.json")
    pk = (f"{LLAMA} --model {MODEL} --passkey --text data/kjv.txt --backend host --cpu-threads 1 "
          f"--lengths 2048,4096,8192 --depths 0.1,0.5,0.9 --budget 256")
    runs.append(f"{pk} --lanes-together --policy-weights {W} --policy oracle,streaming,kvpop --json {T}/passkey.json")
    runs.append(f"{pk} --no-dense --policy-weights {P} --policy kvpop --json {T}/passkey_paper.json")
    return [FETCH,
            f"{PY} scripts/kvpop_decay_search.py --weights {KVPOP_W} --out {W} --report {T}/search.json "
            f"--text {KVPOP_TRAIN_TEXTS} --groups {KVPOP_GROUPS} --grid 0.995 0.998 0.9995 --budget 256 "
            f"--llama {LLAMA} --model {MODEL} --parallel {os.cpu_count()}",
            f"{PY} scripts/kvpop_decay_search.py --weights {W} --paper-out {P}",
            side_by_side(*runs)]


def kvpop_decay_merge(T):
    search = jload(f"{T}/search.json")
    search["args"] = {k: v for k, v in search["args"].items() if k not in ("llama", "parallel", "out", "report")}
    rows = []
    for t, path, ctx, budgets in KVPOP_Q:
        lanes = dict(lanes_of(f"{T}/{t}_{budgets[0]}.json"))
        for b in budgets:
            lanes.update({k: v for k, v in lanes_of(f"{T}/{t}_{b}.json").items() if k != "dense"})
            lanes[f"kvpop_paper@{b}"] = lanes_of(f"{T}/{t}_{b}_paper.json")[f"kvpop@{b}"]
        table = {}
        for lab, l in lanes.items():
            name = lab.split("@")[0]
            decay = {"kvpop": "per layer, chosen by decoding", "kvpop_paper": "the paper's (alpha 0)"}.get(name)
            table[lab] = {"policy": "kvpop" if name.startswith("kvpop") else name, **({"decay": decay} if decay else {}),
                          "budget": l.get("budget"), "perplexity": l["perplexity"], "decode_seconds": l.get("decode_seconds")}
        gaps(table)
        rows += [{"label": lab, "text": path, "context": ctx, "scored": 1024, **r} for lab, r in table.items()]
    found = passkey_found(f"{T}/passkey.json")
    passkey_found(f"{T}/passkey_paper.json", lambda lab: lab.replace("kvpop", "kvpop_paper", 1), found)
    attach_passkey(rows, found)
    return {"what": "KVpop's decay per group of layers chosen by decoding (search: from recency everywhere, = streaming, "
                    "each group alone at each decay, then the best groups combined; perplexity at 256 of 8K on training "
                    "windows, KJV from line 20000 and the Jargon File from line 2000), then the committed scorer with "
                    "those decays against the same scorer at the paper's decay, streaming and the oracle; SmolLM2-135M, "
                    "host backend, sinks 4 + window 64, last 1024 scored of 8K (KJV, the Jargon File, from line 0) and "
                    "of 4K (GPL-3, a text the scorer and its decays never saw)",
            "regenerate": "python3 bench/reproduce.py kvpop_decay_smollm2",
            "passkey": "KJV, lengths 2048/4096/8192, depths 0.1/0.5/0.9, budget 256, greedy answer",
            "search": search, "rows": rows}


# llama_smollm2_kjv_passkey: passkey, dense vs streaming and oracle at 256 / 512.
def passkey_cmds(T):
    return [FETCH, f"{LLAMA} --model {MODEL} --passkey --text data/kjv.txt --backend host --lengths 2048,4096 "
                   f"--depths 0.1,0.5,0.9 --policy streaming,oracle --budget 256,512 --json {T}/out.json"]


# bank_hit_smollm2_kjv4k (JSON lines): the token bank's hit rate on real selections, kvferry-bench
# replaying a 4K KJV trace (5 layers) with --route gpu --bank-slots N on the host backend.
BANK_HIT = [(p, s) for p in ("oracle", "lfps", "streaming") for s in (512, 1024)]


def bank_hit_cmds(T):
    tr = f"{T}/kjv4k5.safetensors"
    return [FETCH, trace_cmd(tr, "data/kjv.txt", 1000, 4096, steps=64, layers="0,8,15,22,29", dtype="bf16")] + [
        f"{BENCH} --trace {tr} --policy {p} --budget 256 --steps 64 --sink 4 --window 64 --backend host "
        f"--route gpu --bank-slots {s} --json {T}/{p}_{s}.json" for p, s in BANK_HIT]


def bank_hit_merge(T):
    rows = []
    for p, s in BANK_HIT:
        r = jload(f"{T}/{p}_{s}.json")
        st = r.get("stats") or {}
        hit, miss = st.get("rows_bank_hit", 0), st.get("rows_fetched", 0)
        r["bank_slots"] = s
        r["bank_hit_rate"] = round(hit / (hit + miss), 4) if hit + miss else None
        rows.append(r)
    return rows


# frontier: speed and quality of every policy the e2e headline times, side by side. Quality runs
# here (host backend, SmolLM2-135M, 8K windows of KJV and the Jargon File, last 1024 scored,
# budget 256, the device policies' defaults, kvpop with its trained scorer); speed is read from
# bench/results/e2e.json (128K x 1, --query real, time over SDPA's in the same call), whose rows
# carry their own provenance: regenerate e2e on the GPU machine at the same commit first.
FRONTIER = (("streaming", "streaming_resident"), ("oracle", "oracle_bank"), ("quest", "quest_bank"),
            ("sparcas", "sparcas_bank"), ("hip", "hip_bank"), ("kvpop", "kvpop_bank"),
            ("xl+sparcas", "xl+sparcas_bank"), ("lfps", "lfps"))


# The papers' own budgets and Quest's page size at a small budget (issue: HiP and KVpop at their
# papers' quality): HiP at k = 512, 1024, 2048 of 8K, KVpop at 75% / 88% compression (2048 / 1024
# of 8K) and 512, with the oracle and streaming at each budget; Quest's pages of 16 / 8 / 4
# tokens at 256 beside the oracle and streaming there. Both texts, side by side, one core each.
BUDGETS_BIG = "512,1024,2048"


def budgets_cmds(T):
    W = "--policy-weights policies/weights/kvpop_smollm2.safetensors"

    def text_cmds(t):
        base = f"{HOST_PPL} --text data/{t}.txt --context 8192 --scored 1024 --cpu-threads 1"
        return " && ".join([
            f"{base} --policy oracle,streaming,hip --budget {BUDGETS_BIG} --json {T}/{t}_big.json",
            f"{base} {W} --policy kvpop --budget {BUDGETS_BIG} --no-dense --json {T}/{t}_kvpop.json",
            f"{base} --policy oracle,streaming,quest --budget 256 --no-dense --json {T}/{t}_quest16.json",
            f"{base} --policy quest --param page=8 --budget 256 --no-dense --json {T}/{t}_quest8.json",
            f"{base} --policy quest --param page=4 --budget 256 --no-dense --json {T}/{t}_quest4.json",
        ])
    return [FETCH, side_by_side(*(text_cmds(t) for t in HQ_TEXTS))]


def budgets_merge(T):
    rows = []
    for t in HQ_TEXTS:
        dense = lanes_of(f"{T}/{t}_big.json").get("dense", {}).get("perplexity")
        lanes = []  # (label, lane, params)
        for f, params in (("big", {}), ("kvpop", {}), ("quest16", {}), ("quest8", {"page": 8}),
                          ("quest4", {"page": 4})):
            lanes += [(lab, l, params) for lab, l in lanes_of(f"{T}/{t}_{f}.json").items() if lab != "dense"]
        oracle = {l["lane"].split("@")[1]: l["perplexity"] for lab, l, _ in lanes if lab.startswith("oracle@")}
        for lab, l, params in lanes:
            policy, budget = lab.split("@")
            gap = 100.0 * (l["perplexity"] / dense - 1)
            og = 100.0 * (oracle[budget] / dense - 1) if budget in oracle else None
            rows.append({"text": f"data/{t}.txt", "context": 8192, "scored": 1024, "policy": policy,
                         "params": params, "budget": int(budget), "perplexity": l["perplexity"],
                         "dense_perplexity": dense, "gap_pct": gap,
                         "gap_over_oracle_gap": gap / og if og else None,
                         "decode_seconds": l.get("decode_seconds")})
    return {"what": "SmolLM2-135M perplexity (last 1024 of 8K, host backend) at the papers' budgets: HiP at "
                    "512-2048 of 8K, KVpop at 75% / 88% compression (2048 / 1024) and 512, the oracle and "
                    "streaming at each; Quest's pages of 16 / 8 / 4 at 256. KJV and the Jargon File",
            "regenerate": "python3 bench/reproduce.py budgets_smollm2", "rows": rows}


def frontier_cmds(T):
    W = "--policy-weights policies/weights/kvpop_smollm2.safetensors"

    def text_cmds(t):
        base = f"{HOST_PPL} --text data/{t}.txt --context 8192 --scored 1024 --cpu-threads 1 --budget 256"
        pols = ",".join(p for p, _ in FRONTIER if p != "kvpop")
        return (f"{base} --policy {pols} --json {T}/{t}.json && "
                f"{base} {W} --policy kvpop --no-dense --json {T}/{t}_kvpop.json")
    return [FETCH, side_by_side(*(text_cmds(t) for t in HQ_TEXTS))]


def frontier_merge(T):
    e2e = jload(os.path.join(RES, "e2e.json"))
    speed = {}
    for r in e2e.get("rows", []):
        fixed = r.get("mode") in ("streaming_resident", "dense_resident")
        if (r.get("name") == "decode" and r.get("context") == 131072 and r.get("batch") == 1
                and r.get("query") == ("repeated (best case)" if fixed else "real") and r.get("ratio")):
            speed[r["mode"]] = r
    quality = {}
    for t in HQ_TEXTS:
        lanes = {**lanes_of(f"{T}/{t}.json"), **lanes_of(f"{T}/{t}_kvpop.json")}
        gaps(lanes)
        quality[t] = lanes
    points = []
    for policy, mode in FRONTIER:
        s = speed.get(mode)
        p = {"policy": policy, "mode": mode, "budget": 256, "context_quality": 8192,
             "ratio_vs_sdpa_128k_b1": s["ratio"] if s else None,
             "ms_per_token_step": s["ms_per_token_step"] if s else None,
             # The speed row's query model (real: the calibrated moving query; repeated: the best
             # case, for the modes whose rows do not depend on it) and where it was measured.
             "speed_query": s.get("query") if s else None,
             "speed_provenance": {"file": "bench/results/e2e.json", **s["provenance"]} if s else None}
        for t in HQ_TEXTS:
            l = quality[t].get(f"{policy}@256", {})
            p[f"perplexity_{t}"] = l.get("perplexity")
            p[f"gap_pct_{t}"] = l.get("gap_pct")
            p[f"gap_over_oracle_gap_{t}"] = l.get("gap_over_oracle_gap")
        points.append(p)
    dense = {t: quality[t]["dense"]["perplexity"] for t in HQ_TEXTS}
    return {"what": "every policy's decode time at 128K x 1 with the real query (ratio to torch SDPA, "
                    "bench/results/e2e.json) against its perplexity gap to dense at 256 of 8K on KJV and the "
                    "Jargon File (this run: SmolLM2-135M, host backend, last 1024 scored)",
            "regenerate": "python3 bench/reproduce.py frontier (after bench/reproduce.py e2e on the GPU machine)",
            "dense_perplexity": dense, "rows": points}


# query_calibration: kvferry-e2e's --query real, fitted to recorded decoding (bench/query_calibration.py):
# the exact top-k's overlap between steps 1-32 apart on SmolLM2 8K traces of both texts, the same on
# kvferry-e2e's own keys and moving query over a grid of (drift, rho) at 32K (and the chosen point
# at 128K), and the token bank's hit rate of the policies' real selections (kvferry-bench replaying
# the traces on the host backend, 1.8% of the offloaded positions picked as at 128K, slots for twice
# the picks as kvferry-e2e's _bank modes). The GPU rows of e2e.json at --query real carry the
# synthetic hit rates to set beside them.
QC_POLICIES = ("oracle", "sparcas", "quest", "hip")
QC_BUDGET, QC_SLOTS = 214, 292  # 8K: 146 picks (1.8% of 8124 offloaded) + sink 4 + window 64


def qc_cmds(T):
    qc = f"{PY} bench/query_calibration.py"
    return [FETCH,
            side_by_side(*(trace_cmd(f"{T}/{t}8k.safetensors", f"data/{t}.txt", 0, 8192, dtype="bf16")
                           + " --cpu-threads 1" for t in HQ_TEXTS)),
            f"{qc} traces " + " ".join(f"--trace {t}={T}/{t}8k.safetensors" for t in HQ_TEXTS)
            + f" --steps 96 --json {T}/traces.json",
            f"{qc} synthetic --context 32768 --steps 64 --drifts 0.1,0.2,0.3,0.33,0.36,0.4,0.45,0.5 "
            f"--rhos 0,0.3,0.5,0.7,0.9 --json {T}/synth32k.json",
            f"{qc} synthetic --context 131072 --heads 2 --steps 64 --drifts 0.36 --rhos 0.3 --json {T}/synth128k.json",
            *[f"{BENCH} --trace {T}/{t}8k.safetensors --policy {p} --budget {QC_BUDGET} --steps 64 --sink 4 "
              f"--window 64 --backend host --route gpu --bank-slots {QC_SLOTS} --no-accuracy --json {T}/bank_{t}_{p}.json"
              for t in HQ_TEXTS for p in QC_POLICIES]]


def qc_real_point():
    """kvferry-e2e's --query real constants, read from its source."""
    src = open(os.path.join(ROOT, "bench", "e2e_bench.cu")).read()
    get = lambda name: float(src.split(f"constexpr double {name} = ", 1)[1].split(";", 1)[0])
    return {"drift": get("kRealQueryDrift"), "rho": get("kRealQueryRho")}


def qc_merge(T):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import query_calibration as qc
    traces, synth, s128 = jload(f"{T}/traces.json"), jload(f"{T}/synth32k.json"), jload(f"{T}/synth128k.json")
    err, best = qc.fit(traces, synth)
    real = qc_real_point()
    chosen = next((g for g in synth["grid"] if g["drift"] == real["drift"] and g["rho"] == real["rho"]), None)
    bank = []
    for t in HQ_TEXTS:
        for p in QC_POLICIES:
            st = jload(f"{T}/bank_{t}_{p}.json")["stats"]
            hit, miss = st["rows_bank_hit"], st["rows_fetched"]
            bank.append({"text": t, "policy": p, "budget": QC_BUDGET, "bank_slots": QC_SLOTS, "steps": 64,
                         "bank_hit_rate": round(hit / (hit + miss), 4) if hit + miss else None})
    lags = sorted(traces["mean"], key=int)
    return {"what": "kvferry-e2e's moving query calibrated to real decoding: the exact top-k's overlap between "
                    "steps L apart (the share of step t's top-k that was in step t - L's), on SmolLM2 8K traces "
                    "and on kvferry-e2e's keys and query, and the token bank's hit rate on the traces",
            "regenerate": "python3 bench/reproduce.py query_calibration",
            "fraction_picked": traces["fraction"],
            "traces": {"mean": traces["mean"], "per_text": traces["per_text"],
                       "per_layer": traces["rows"]},
            "fit": {"drift": best["drift"], "rho": best["rho"], "rms_error": round(err, 4),
                    "overlap": best["overlap"]},
            "real": {**real, "overlap_32k": chosen["overlap"] if chosen else None,
                     "overlap_128k": s128["grid"][0]["overlap"],
                     "max_gap_to_traces_32k": round(max(abs(chosen["overlap"][l] - traces["mean"][l])
                                                        for l in lags), 4) if chosen else None},
            "grid_32k": synth["grid"],
            "rows": bank}


# real_model_gpu: SmolLM2-135M decoding on the GPU through kvferry-llama --backend cuda (cuBLAS
# matrix products, attention through the Runtime's CUDA backend), every policy at budget 256 of
# 2K/4K/8K windows of KJV (the last 256 tokens scored), batch 1 (each lane alone) and, at 8K, batch 8
# (8 sequences of one policy decoded together, --lanes-together) and the device policies with a
# token bank; the same perplexity runs on the host backend of the same machine at 2K/4K for the
# agreement check (the host engine decodes at ~7-16 steps/s there, so 8K is left out to fit one
# 10-minute call), passkey on both backends, and the report the main job prints with --backend
# auto. The model and the text must be in data/ (the GPU machine has no network: bash
# scripts/fetch-data.sh on a machine with one, then copy data/).
RM_POLICIES = "oracle,streaming,lfps,sparcas,quest,hip"
RM_ALL = ("dense", *RM_POLICIES.split(","), "kvpop")  # every lane: dense, the above, kvpop (trained)
RM_CONTEXTS = (2048, 4096, 8192)
RM_HOST_CONTEXTS = (2048, 4096)
RM_B8_CONTEXTS = (8192,)
RM_SCORED = 256
RM_RESIDENT_CTX = 8192
RM_WEIGHTS = "--policy-weights policies/weights/kvpop_smollm2.safetensors"


def real_model_cmds(T):
    """In order of need, so that a run cut short keeps the agreement and batch-1 rows: batch 1 on both
    backends, passkey, the report, batch 8, then the device policies with a token bank."""
    L = f"{LLAMA} --model {MODEL}"
    cmds = [f"test -s {MODEL} && test -s data/kjv.txt"]

    def ppl(ctx):
        return (f"--perplexity --text data/kjv.txt --offset-lines 1000 --context {ctx} --scored {RM_SCORED} "
                f"--budget 256")
    for ctx in RM_CONTEXTS:
        for be in ("cuda", "host") if ctx in RM_HOST_CONTEXTS else ("cuda",):
            tog = " --lanes-together" if be == "host" else ""  # the host rows are for agreement only
            cmds.append(f"{L} --backend {be}{tog} {ppl(ctx)} --policy {RM_POLICIES} --json {T}/{be}_b1_{ctx}.json")
            cmds.append(f"{L} --backend {be}{tog} {ppl(ctx)} {RM_WEIGHTS} --policy kvpop --no-dense "
                        f"--json {T}/{be}_b1_kvpop_{ctx}.json")
    # The baseline of the engine's decode: dense with every token resident on the GPU (a window that
    # covers the context), batch 1 and 8, and batch 1 launched kernel by kernel (no CUDA graphs).
    res = (f"--perplexity --text data/kjv.txt --offset-lines 1000 --context {RM_RESIDENT_CTX} --scored {RM_SCORED} "
           f"--window {RM_RESIDENT_CTX + 64} --budget {RM_RESIDENT_CTX + 128} --no-dense")
    cmds.append(f"{L} --backend cuda {res} --policy dense --json {T}/cuda_b1_resident_{RM_RESIDENT_CTX}.json")
    cmds.append(f"{L} --backend cuda {res} --policy dense --no-graphs "
                f"--json {T}/cuda_b1_resident_nographs_{RM_RESIDENT_CTX}.json")
    cmds.append(f"{L} --backend cuda --lanes-together {res} --policy {','.join(['dense'] * 8)} "
                f"--json {T}/cuda_b8_resident_{RM_RESIDENT_CTX}.json")
    pk = "--passkey --text data/kjv.txt --depths 0.1,0.5,0.9 --policy oracle,lfps,sparcas,quest,hip --budget 256"
    cmds.append(f"{L} --backend cuda {pk} --lengths 2048,4096 --json {T}/passkey_cuda.json")
    cmds.append(f"{L} --backend host --lanes-together {pk} --lengths 2048 --json {T}/passkey_host.json")
    cmds.append(f"{L} --backend auto --report --chat --text data/kjv.txt --context 8192 --scored 1024 "
                f"--offset-lines 1000 --policy lfps --budget 256 --window 192 --json {T}/report.json")
    for ctx in RM_B8_CONTEXTS:
        for p in RM_ALL:
            w = f" {RM_WEIGHTS}" if p == "kvpop" else ""
            cmds.append(f"{L} --backend cuda --lanes-together {ppl(ctx)}{w} --policy {','.join([p] * 8)} --no-dense "
                        f"--json {T}/cuda_b8_{p}_{ctx}.json")
        # real queries against the token bank (slots for twice the budget)
        cmds.append(f"{L} --backend cuda {ppl(ctx)} --bank-slots 512 --policy oracle,sparcas,quest,hip --no-dense "
                    f"--json {T}/cuda_bank_{ctx}.json")
        cmds.append(f"{L} --backend cuda {ppl(ctx)} --bank-slots 512 {RM_WEIGHTS} --policy kvpop --no-dense "
                    f"--json {T}/cuda_bank_kvpop_{ctx}.json")
    return cmds


def rm_lane_row(lane, backend, ctx, batch, run):
    st = lane.get("stats", {})
    steps = max(1, st.get("decode_steps", 0))
    sel = st.get("rows_selected", 0)
    hit, fetched = st.get("rows_bank_hit", 0), st.get("rows_fetched", 0)
    return {"backend": backend, "context": ctx, "batch": batch, "policy": lane["policy"],
            "query": "the model's own (real decoding)",
            "budget": None if lane["policy"] == "dense" else lane["budget"],
            "perplexity": lane["perplexity"],
            "decode_tokens_per_second": lane["decode_tokens_per_second"] * batch,
            "prefill_tokens_per_second": run["prefill_tokens"] / run["prefill_seconds"] if run["prefill_seconds"] else None,
            "decode_pcie_bytes_per_token": lane["decode_pcie_bytes_per_token"],
            "gpu_kv_bytes_per_sequence": lane["gpu_kv_bytes_per_sequence"],
            "device_bytes_reserved": lane["device_bytes_reserved"],
            # the share of the offloaded picks the token bank served (the rest crossed PCIe)
            "bank_hit_rate": hit / (hit + fetched) if hit + fetched > 0 and hit > 0 else None,
            "rows_selected_per_layer_step": sel / steps,
            "rows_bank_hit_per_layer_step": hit / steps,
            "rows_fetched_per_layer_step": fetched / steps,
            "host_syncs_per_layer_step": st.get("host_syncs", 0) / steps,
            "decode_on_device": run.get("decode_on_device"),
            "run_decode_graph_steps": run.get("decode_graph_steps"),  # every lane of the run together
            "ms_attend_gpu_per_step": st.get("ms_attend_gpu", 0) / steps}


def real_model_merge(T):
    rows, agree = [], []
    for ctx in RM_CONTEXTS:
        per = {}
        for be in ("cuda", "host"):
            for f in (f"{T}/{be}_b1_{ctx}.json", f"{T}/{be}_b1_kvpop_{ctx}.json"):
                if not os.path.exists(f):  # a run cut short: left out
                    continue
                run = jload(f)
                for lane in run["lanes"]:
                    r = rm_lane_row(lane, be, ctx, 1, run)
                    per[be, lane["policy"]] = r
                    if be == "cuda":
                        rows.append(r)
        for p in RM_ALL:
            f = f"{T}/cuda_b8_{p}_{ctx}.json"
            if os.path.exists(f):
                run = jload(f)
                lanes = run["lanes"]
                r = rm_lane_row(lanes[0], "cuda", ctx, len(lanes), run)
                r["perplexity_spread"] = max(l["perplexity"] for l in lanes) - min(l["perplexity"] for l in lanes)
                rows.append(r)
            c, h = per.get(("cuda", p)), per.get(("host", p))
            if c and h:
                agree.append({"context": ctx, "policy": p, "perplexity_cuda": c["perplexity"],
                              "perplexity_host": h["perplexity"],
                              "rel_diff": abs(c["perplexity"] / h["perplexity"] - 1)})
        for f in (f"{T}/cuda_bank_{ctx}.json", f"{T}/cuda_bank_kvpop_{ctx}.json"):
            if os.path.exists(f):
                run = jload(f)
                rows += [dict(rm_lane_row(lane, "cuda", ctx, 1, run), bank_slots=512) for lane in run["lanes"]]
    for name, batch in (("cuda_b1_resident", 1), ("cuda_b1_resident_nographs", 1), ("cuda_b8_resident", 8)):
        f = f"{T}/{name}_{RM_RESIDENT_CTX}.json"
        if os.path.exists(f):
            run = jload(f)
            r = rm_lane_row(run["lanes"][0], "cuda", RM_RESIDENT_CTX, batch, run)
            r["policy"] = "dense_resident_nographs" if "nographs" in name else "dense_resident"
            rows.append(r)
    for r in rows:  # decode speed against dense with every token resident, same context and batch
        d = next((x for x in rows if x["policy"] == "dense_resident" and x["context"] == r["context"]
                  and x["batch"] == r["batch"]), None)
        r["decode_vs_dense_resident"] = r["decode_tokens_per_second"] / d["decode_tokens_per_second"] if d else None
    for r in rows:  # decode speed against dense on the same backend, context and batch
        d = next((x for x in rows if x["policy"] == "dense" and x["context"] == r["context"]
                  and x["batch"] == r["batch"] and "bank_slots" not in x), None)
        r["decode_vs_dense"] = r["decode_tokens_per_second"] / d["decode_tokens_per_second"] if d else None
    passkey = []
    for be in ("cuda", "host"):
        if not os.path.exists(f"{T}/passkey_{be}.json"):
            continue
        pk = jload(f"{T}/passkey_{be}.json")
        passkey.append({"backend": be, **{k: v for k, v in pk.items() if k not in ("mode",)}})
    report = jload(f"{T}/report.json") if os.path.exists(f"{T}/report.json") else None
    return {"bench": "real_model_gpu", "model": MODEL,
            "notes": "SmolLM2-135M (Q4_1 GGUF) through kvferry-llama: matrix products on cuBLAS, attention "
                     "through the Runtime's CUDA backend; KJV from line 1000, the last 256 tokens of each window "
                     "scored; sinks 4 + window 64, budget 256; batch 1 = one lane alone, batch 8 = 8 sequences of "
                     "one policy decoded together (tokens/s counts all 8). agreement: the same runs on the host "
                     "backend of the same machine.",
            "regenerate": "python3 bench/reproduce.py real_model_gpu",
            "rows": rows, "agreement": agree, "passkey": passkey, "report": report}


# hf_gpu: Hugging Face transformers on the GPU, transformers' SDPA with its DynamicCache against the
# same model with attn_implementation="kvferry" (bench/hf_gpu.py), one process: SmolLM2-135M (from
# the GGUF) at 8K, batch 1 and 8, budget 256; a Llama with the 8B attention and MLP shape, 8 layers of
# random bf16 weights, at 32K and 128K, batch 1, budget 2%. Needs transformers and gguf (the GPU
# machine has transformers; carry gguf as a wheel).
HF_LANES = "sdpa,sdpa_nocudnn,dense,streaming,sparcas,sparcas_bank,quest,quest_bank,hip,hip_bank"


def hf_gpu_cmds(T):
    run = f"PYTHONPATH={B}/python${{PYTHONPATH:+:$PYTHONPATH}} {PY} bench/hf_gpu.py"
    return [f"rm -f {T}/smollm2.jsonl {T}/llama8b.jsonl && test -s {MODEL}",
            f"{run} --model smollm2 --contexts 8192 --batches 1,8 --budget 256 --lanes {HF_LANES} "
            f"--json {T}/smollm2.jsonl",
            f"{run} --model llama8b --layers 8 --contexts 32768,131072 --batches 1 --budget 2% --lanes {HF_LANES} "
            f"--json {T}/llama8b.jsonl"]


def hf_gpu_merge(T):
    rows = []
    for f in ("smollm2", "llama8b"):
        if os.path.exists(f"{T}/{f}.jsonl"):
            rows += [json.loads(l) for l in open(f"{T}/{f}.jsonl") if l.strip()]
    return {"bench": "hf_gpu",
            "notes": "decode tokens/s (every sequence of the batch) over 31 greedy steps after a warm-up, each lane "
                     "in the same process; sdpa = transformers' SDPA + DynamicCache, dense = kvferry with every "
                     "token resident, a policy = kvferry at the budget (sinks 4 + window 64), _bank = with a token "
                     "bank of twice the budget's slots; kv_gpu_bytes: the K/V kept in GPU memory",
            "regenerate": "python3 bench/reproduce.py hf_gpu", "rows": rows}


SPECS = {
    "e2e": dict(gpu=True, targets=["kvferry-e2e"], run=e2e_cmds, merge=e2e_merge,
                what="the Runtime end to end per token step (32 layers, Llama-3.1-8B shape) vs torch SDPA, "
                     "the device policies with the real and the repeated query, baselines, chunked prefill"),
    "scale": dict(gpu=True, targets=["kvferry-e2e"], run=scale_cmds, merge=scale_merge,
                  what="(context, batch) points under an 8 GiB GPU cap with full-streaming, dense-CPU and "
                       "uncapped-SDPA baselines; the scheduler's routes"),
    "split": dict(gpu=True, targets=["kvferry-e2e"], run=split_cmds, merge=split_merge,
                  what="the scheduler's GPU/CPU split vs the single routes at 128K"),
    "quality_gemma3_32k": dict(gpu=False, targets=[], examples=True, run=quality_gemma3_cmds,
                               merge=quality_gemma3_merge,
                               what="Gemma 3 270M at 16K/32K: perplexity (KJV, Jargon) and passkey (8K-32K) of every "
                                    "policy at 2% of the context"),
    "real_model_gpu": dict(gpu=True, targets=[], examples=True, run=real_model_cmds, merge=real_model_merge,
                           what="SmolLM2-135M decoding on the GPU (kvferry-llama --backend cuda): every policy's "
                                "perplexity and tokens/s at 2K/4K/8K, batch 1 and 8; CUDA vs host agreement; passkey"),
    "hf_gpu": dict(gpu=True, targets=["_core"], python=True, run=hf_gpu_cmds, merge=hf_gpu_merge,
                   what="Hugging Face on the GPU: transformers' SDPA vs attn_implementation=\"kvferry\" "
                        "(SmolLM2 8K b1/b8, an 8B-shaped model at 32K/128K): tokens/s, GPU memory, tokens"),
    "quality_smollm2": dict(gpu=False, targets=["kvferry-bench"], examples=True, run=quality_cmds,
                            merge=quality_merge,
                            what="perplexity gap, passkey and attention-mass recall of every policy on SmolLM2-135M"),
    "gpu_attention": simple("gpu_attention_bench", "{OUT}", True,
                            "dense and sparse decode kernels (HBM GB/s) and the PCIe transfer probe"),
    "torch_sdpa": dict(gpu=True, targets=["gpu_attention_bench"], run=torch_sdpa_cmds, merge=load_out,
                       what="kvferry's dense decode kernel vs torch SDPA, same run"),
    "transfer_span": simple("span_bench", "{OUT}", True,
                            "zero-copy gather rate vs the span of host memory the rows lie in"),
    "select_topk": simple("select_topk_bench", "{OUT}", True, "the device selection's multi-CTA top-k"),
    "cpu_attention": simple("cpu_attention_bench", "{OUT}", False,
                            "CPU sparse / dense attention throughput vs threads"),
    "lfps": simple("lfps_bench", "{OUT}", False, "LFPS vs exact top-k on the synthetic workload, one core"),
    "lfps_select_speed": simple("lfps_select_bench", "--json {OUT}", False,
                                "LFPS Select time per head vs exact top-k, one thread"),
    "prefill_host": dict(gpu=False, targets=[], run=prefill_host_cmds, merge=load_out,
                         out=lambda: f"prefill_host_{os.cpu_count()}core",
                         what="dense prefill on the host backend before/after (writes prefill_host_<cores>core.json)"),
    "soak": dict(gpu=False, targets=["kvferry_soak"], run=soak_cmds, merge=load_out,
                 what="1M decode steps of the host backend: RSS, store and device bytes stay flat"),
    "trace_step_split_kvpop": dict(gpu=True, targets=["kvferry-e2e"], run=trace_cmds, merge=load_out,
                                   what="a Chrome trace of kvpop's split step at 32K x 4 (Runtime::StartTrace)"),
    # Studies on SmolLM2-135M (host backend) and LFPS's step on the GPU.
    "lfps_quality_smollm2": dict(gpu=False, targets=[], examples=True, run=lfps_quality_cmds, merge=lfps_quality_merge,
                                 what="LFPS (paper's candidates vs defaults) perplexity vs dense/streaming/oracle, "
                                      "SmolLM2, KJV + Jargon 4K"),
    "lfps_recall_smollm2": dict(gpu=False, targets=["lfps_bench"], examples=True, run=lfps_recall_cmds,
                                merge=lfps_recall_merge,
                                what="LFPS recall of the exact top-k per layer/head on SmolLM2 4K traces "
                                     "(lfps_bench --trace), 9 variants"),
    "lfps_step_profile": dict(gpu=True, targets=["kvferry-e2e"], run=step_profile_cmds, merge=step_profile_merge,
                              what="where LFPS's runtime step goes at 32K/64K: phase profile + traced step, "
                                   "5 variants x 2 repeats"),
    "prhs_etf_smollm2": dict(gpu=False, targets=[], examples=True, run=prhs_etf_cmds, merge=prhs_etf_merge,
                             what="PrHS early-token freezing off / projected / copy_kv: perplexity, SmolLM2 KJV 8K"),
    "prhs_lfps_quality_smollm2": dict(gpu=False, targets=[], examples=True, run=prhs_lfps_cmds, merge=prhs_lfps_merge,
                                      what="cis+/psaw+/xl+lfps vs lfps and oracle: perplexity, SmolLM2 KJV 4K, budget 256"),
    "prhs_rho_smollm2": dict(gpu=False, targets=["kvferry-bench"], examples=True, run=prhs_rho_cmds,
                             merge=prhs_rho_merge,
                             what="CIS reuse ratio rho, recall and error on a SmolLM2 2K trace; cis perplexity"),
    "hip_quality_smollm2": dict(gpu=False, targets=[], examples=True, run=hip_quality_cmds, merge=hip_quality_merge,
                                what="HiP perplexity (KJV + Jargon 8K) and passkey, before and after its recall guard"),
    "hip_drift_smollm2": dict(gpu=False, targets=[], examples=True, run=hip_drift_cmds, merge=hip_drift_merge,
                              what="HiP's mask rebuilt on query drift (the default; 0.8) vs the paper's cadence / every step, streaming, oracle"),
    "sparcas_refresh": dict(gpu=True, targets=["kvferry-e2e"], run=sparcas_refresh_cmds, merge=sparcas_refresh_merge,
                            what="sparcas_bank at 128K x 1/x 4 over 130 steps (real query) for u = 64, 256, never; torch SDPA"),
    "kernel_profile": dict(gpu=True, targets=["kvferry-e2e"], run=kernel_profile_cmds, merge=kernel_profile_merge,
                           what="each device policy's decode layer kernel by kernel (ncu, 128K x 1, steady state): time, bytes, HBM and PCIe fractions"),
    "sparcas_refresh_smollm2": dict(gpu=False, targets=[], examples=True, run=sparcas_refresh_quality_cmds,
                                    merge=sparcas_refresh_quality_merge,
                                    what="SparCas's dimension refresh every u = 64/256/1024/never: perplexity, SmolLM2 KJV + Jargon 8K, GPL-3 4K"),
    "knorm_smollm2": dict(gpu=False, targets=[], examples=True, run=knorm_quality_cmds, merge=knorm_quality_merge,
                          what="knorm (smallest key norms) perplexity next to streaming and the oracle: SmolLM2 KJV + Jargon 8K, GPL-3 4K"),
    "hip_speed": dict(gpu=True, targets=["kvferry-e2e"], run=hip_speed_cmds, merge=hip_speed_merge,
                      what="hip_bank at 128K x 1/x 4 (real query): default (drift 0.7, lag 0), the paper's cadence, every step, the paper's even first nodes (align=0); torch SDPA"),
    "hip_kvpop_replay_smollm2": dict(gpu=False, targets=["select_replay_bench"], examples=True, run=replay_cmds,
                                     merge=replay_merge,
                                     what="HiP and KVpop variants replayed on 8K SmolLM2 traces: recall, mass, error per layer"),
    "kvpop_mass_smollm2": dict(gpu=False, targets=["kvferry-bench"], examples=True, run=kvpop_mass_cmds,
                               merge=kvpop_mass_merge,
                               what="KVpop's untrained attention-mass scorer: gamma sweep, passkey, replay, held-out text"),
    "kvpop_train_smollm2": dict(gpu=False, targets=[], examples=True, run=kvpop_train_cmds, merge=kvpop_train_merge,
                                what="KVpop's MLP scorer trained on SmolLM2 traces (scripts/kvpop_train.py; needs torch)"),
    "kvpop_decay_smollm2": dict(gpu=False, targets=[], examples=True, run=kvpop_decay_cmds, merge=kvpop_decay_merge,
                                what="KVpop's decay per layer group chosen by decoding; its quality vs the paper's decay, "
                                     "streaming, oracle (256-2048 of 8K, GPL-3 4K, passkey)"),
    "llama_smollm2_kjv_passkey": dict(gpu=False, targets=[], examples=True, run=passkey_cmds, merge=load_out,
                                      what="passkey 2K/4K x 3 depths: dense vs streaming and oracle at 256/512"),
    "budgets_smollm2": dict(gpu=False, targets=[], examples=True, run=budgets_cmds, merge=budgets_merge,
                            what="HiP and KVpop at their papers' budgets (512-2048 of 8K) and Quest's page size "
                                 "at 256, beside the oracle and streaming, on KJV and the Jargon File"),
    "frontier": dict(gpu=False, targets=[], examples=True, run=frontier_cmds, merge=frontier_merge,
                     what="every policy's 128K decode time (real query, from e2e.json) against its perplexity gap "
                          "at 256 on KJV and the Jargon File"),
    "query_calibration": dict(gpu=False, targets=["kvferry-bench"], examples=True, run=qc_cmds, merge=qc_merge,
                              what="kvferry-e2e's --query real fitted to the exact top-k's overlap across steps on "
                                   "SmolLM2 traces; bank hit rates of real selections (needs numpy)"),
    "bank_hit_smollm2_kjv4k": dict(gpu=False, targets=["kvferry-bench"], examples=True, run=bank_hit_cmds,
                                   merge=bank_hit_merge, ext="jsonl",
                                   what="token-bank hit rate on real selections (SmolLM2 KJV 4K trace, 512/1024 slots)"),
}

# Where each name runs and about how long, for --list: the machine kind (nvidia-h200: 1 H200, 16
# cores, 128 GiB, the lent GPU machine; the CPU studies' committed rows ran on a 2-core VM) and the
# run time, inferred from the committed files (their recorded seconds) or from the run's size;
# "?" where nothing recorded says.
GPU1 = "GPU: 1x H100/H200 + 16 cores (nvidia-h200)"
GPU1_RAM = "GPU: 1x H100/H200 + 16 cores, 128 GiB RAM (nvidia-h200)"
CPU2 = "CPU: host backend, 2+ cores"
MACHINE = {
    "e2e": (GPU1_RAM, "~8 min (454 s recorded on an H100 with the binaries built: 40 rows, SDPA, prefill)"), "scale": (GPU1_RAM, "~13 min in two calls on one warm machine (730 s recorded on an H200: "
                                   "SCALE_POINTS=32768x4,131072x1,dense 210 s, then 131072x4,524288x1 520 s)"), "split": (GPU1_RAM, "?"),
    "quality_gemma3_32k": (CPU2, "~70 min on 2 cores (70 min recorded, the last 25 beside CI: two chains side by side, 28 lanes decoded together after each of 4 prefills of 16K/32K, 9 passkey prompts of 85-880 s)"),
    "hf_gpu": (GPU1, "~4 min with _core built (recorded: about 3.5 min for 10 lanes, sdpa_nocudnn included, at SmolLM2 8K b1/b8 and the 8B shape at 32K/128K)"),
    "real_model_gpu": (GPU1, "~9 min with kvferry-llama built (recorded: about 8.7 min with the engine's device decode, 7.8 in a 10-minute call that was cut after the batch-8 quest row, then the last 4 commands in 50 s on the same warm machine)"),
    "quality_smollm2": (CPU2, "~25 min on 2 cores (23 min recorded: 13 lanes of 1024 tokens decoded together, + 5 runs of 1-2 lanes, passkey, 14 replays)"),
    "gpu_attention": (GPU1, "?"), "torch_sdpa": (GPU1, "?"), "transfer_span": (GPU1, "?"),
    "select_topk": (GPU1, "?"), "cpu_attention": ("CPU: 16 cores (the GPU machine's)", "?"),
    "lfps": ("CPU: one core", "?"), "lfps_select_speed": ("CPU: one core", "?"),
    "prefill_host": ("CPU: any (also builds the base commit)", "?"),
    "soak": ("CPU: host backend", "~2 min (68 s recorded)"),
    "trace_step_split_kvpop": (GPU1, "~2 min (one 32K x 4 call)"),
    "lfps_quality_smollm2": (CPU2, "~95 min on 2 cores (5413 s of decode recorded, + 6 prefills of 4K)"),
    "lfps_recall_smollm2": ("CPU: one core", "~35 min (~1200 s of select + exact top-k recorded, + 2 traces)"),
    "lfps_step_profile": (GPU1, "~15 min (10 kvferry-e2e calls at 32K + 64K, SDPA baselines)"),
    "prhs_etf_smollm2": (CPU2, "~20 min on 2 cores (3 runs of 8K, 2 lanes each)"),
    "prhs_lfps_quality_smollm2": (CPU2, "~12 min on 2 cores (676 s recorded)"),
    "prhs_rho_smollm2": (CPU2, "~15 min on 2 cores (a 2K trace, 15 replays, 3 perplexity runs of 2K)"),
    "hip_quality_smollm2": (CPU2, "~60 min on 2 cores (62 min recorded beside other work: two texts side by side, 10 lanes each; passkey 9 prompts, 2 runs)"),
    "hip_drift_smollm2": (CPU2, "~60 min on 2 cores (61 min recorded: two texts side by side, 28 lanes each + dense; GPL-3 4K 14 lanes + dense; passkey 9 prompts)"),
    "kernel_profile": (GPU1_RAM, "~5 min (four modes, two ncu runs each over a 128K fill)"),
    "sparcas_refresh": (GPU1, "~4 min (three kvferry-e2e runs of 128K x 1 and x 4 over 130 steps, SDPA)"),
    "sparcas_refresh_smollm2": (CPU2, "~30 min on 2 cores (two 8K texts side by side, 6 lanes + dense each; GPL-3 4K)"),
    "hip_speed": (GPU1, "~4 min (four kvferry-e2e runs of 128K x 1 and x 4, SDPA)"),
    "hip_kvpop_replay_smollm2": (CPU2, "~30 min on 2 cores (30 min recorded beside other work: two 8K traces, 17 lanes x 512 steps x 30 layers each)"),
    "kvpop_mass_smollm2": (CPU2, "~65 min on 2 cores (12 runs of 8K, ~96 s of decode a lane recorded)"),
    "kvpop_train_smollm2": ("CPU: 2 threads, torch + safetensors", "~22 min (recorded: 5 traces ~4 min, their targets ~14 min, 400 steps ~4 min)"),
    "kvpop_decay_smollm2": ("CPU: as many perplexity runs at a time as cores", "~50 min on 2 cores (recorded: the search's 30 runs of 8K at 256, ~25 min; then 20 runs of 8K/4K and 2 passkey runs at once, ~25 min)"),
    "llama_smollm2_kjv_passkey": (CPU2, "~5 min on 2 cores (6 prompts of 2K/4K, 5 lanes)"),
    "budgets_smollm2": (CPU2, "~32 min on 2 cores (32 min recorded: two texts side by side, 5 prefills and 17 lanes of 1024 tokens each)"),
    "frontier": (CPU2, "~10 min on 2 cores (9 min recorded: two texts side by side, 8 lanes + dense of 1024 tokens each)"),
    "query_calibration": (CPU2, "~9 min on 2 cores (recorded: two 8K traces, overlaps of 60 layer traces and "
                                "40 + 1 synthetic points, 8 bank replays of 64 steps)"),
    "bank_hit_smollm2_kjv4k": (CPU2, "~3 min (a 5-layer 4K trace, 6 replays of 64 steps)"),
}


# ------------------------------------------------------------------------------------- provenance
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return ""


def provenance(commands):
    # KVFERRY_SOURCE_COMMIT: the commit of a tree copied without its history (the GPU machine's copy
    # of a working tree sits on another HEAD, so git there names the wrong commit).
    commit = os.environ.get("KVFERRY_SOURCE_COMMIT") or sh("git rev-parse --short=10 HEAD") or "unknown"
    if not os.environ.get("KVFERRY_SOURCE_COMMIT") and sh("git status --porcelain --untracked-files=no"):
        commit += "+dirty"
    gpu = sh("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1")
    name, _, driver = gpu.partition(",")
    model, cores = "unknown", os.cpu_count()
    try:
        model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "gpu": name.strip() or "none", "driver": driver.strip() or "n/a", "cpu": f"{model}, {cores} cores",
            "command": " && ".join(commands)}


ROW_KEYS = ("rows", "runs", "dense", "sparse", "sparse_pool", "dense_decode", "llama_prefill", "lanes", "trials",
            "history", "sweep_budget_256", "default", "passkey")


def stamp(d, p):
    """Provenance on the file and on every row of its row lists (a list of rows: each row; a
    dict of runs, as lfps_recall_smollm2's: each run)."""
    if isinstance(d, list):
        return [{**r, "provenance": p} if isinstance(r, dict) else r for r in d]
    if isinstance(d, dict):
        for key in ROW_KEYS:
            v = d.get(key)
            rows = v if isinstance(v, list) else list(v.values()) if isinstance(v, dict) else []
            for r in rows:
                if isinstance(r, dict):
                    r["provenance"] = p
        if "traceEvents" in d:
            d.setdefault("otherData", {})["provenance"] = p
        else:
            d = {"provenance": p, **{k: v for k, v in d.items() if k != "provenance"}}
    return d


def build(spec):
    targets = spec["targets"]
    if not targets and not spec.get("examples"):
        return []
    archs = os.environ.get("KVFERRY_CUDA_ARCHS", "90")
    cfg = (f"cmake -S . -B {B} -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFERRY_CUDA_ARCHS={archs} "
           f"-DKVFERRY_BUILD_EXAMPLES={'ON' if spec.get('examples') else 'OFF'}"
           + (" -DKVFERRY_BUILD_PYTHON=ON -DPython_EXECUTABLE=$(command -v python3)" if spec.get("python") else ""))
    tg = " ".join(targets + (["kvferry-llama"] if spec.get("examples") else []))
    return [cfg, f"cmake --build {B} -j{os.environ.get('JOBS', os.cpu_count())} --target {tg}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--no-build", action="store_true", help="use the binaries already in $B")
    ap.add_argument("--merge-only", action="store_true",
                    help="run nothing: write the file from the outputs an earlier run left in $T (e.g. "
                         "frontier once e2e.json is regenerated)")
    a = ap.parse_args()
    if a.list or not a.name:
        for n, s in SPECS.items():
            machine, est = MACHINE.get(n, ("?", "?"))
            print(f"{n:26s} {'GPU' if s['gpu'] else 'CPU':4s} {s['what']}\n{'':31s}machine: {machine}; time: {est}")
        return 0
    if a.name not in SPECS:
        print(f"reproduce: unknown name {a.name}; --list shows them")
        return 2
    spec = SPECS[a.name]
    T = os.environ.get("T", f"/tmp/kvferry-reproduce/{a.name}")
    cmds = ([] if a.no_build else build(spec)) + spec["run"](T)
    if a.dry_run:
        print("\n".join(cmds))
        return 0
    if spec["gpu"] and not shutil.which("nvidia-smi"):
        print(f"reproduce: {a.name} needs an NVIDIA GPU (nvidia-smi not found); nothing run")
        return 3
    os.makedirs(T, exist_ok=True)
    for c in ([] if a.merge_only else cmds):
        print("+", c, flush=True)
        rc = subprocess.run(["bash", "-c", c], cwd=ROOT).returncode
        if rc:
            print(f"reproduce: command failed (rc {rc}): {c}")
            return rc
    out_name = spec["out"]() if "out" in spec else a.name
    d = stamp(spec["merge"](T), provenance(spec["run"](T)))
    path = os.path.join(RES, f"{out_name}.{spec.get('ext', 'json')}")
    with open(path, "w") as f:
        if isinstance(d, list):  # JSON lines: one row a line
            f.writelines(json.dumps(r) + "\n" for r in d)
        else:
            json.dump(d, f, indent=1)
            f.write("\n")
    print(f"reproduce: wrote {os.path.relpath(path, ROOT)}; python3 scripts/docs_tables.py refreshes the docs, "
          f"python3 bench/plot.py the plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
