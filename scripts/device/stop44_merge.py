#!/usr/bin/env python3
"""Adds stop 44's route rows (scripts/device/stop44_a.sh, stop44_b.sh) to the scale table
(bench/results/scale_h100.json) and to the split file (bench/results/split_h100.json).

Each call ran torch SDPA uncapped in the same call (e2e_stop44a.json / e2e_stop44b.json). The
route rows are eager steps (ms_per_token_step_no_graph): a step captured in a CUDA graph holds no
host work, so it is gpu-only whatever the route; its time is kept as ms_per_token_step_graph.
Usage: python3 scripts/device/stop44_merge.py   (from the repository root; idempotent)
"""
import json
import os

RES = "bench/results"
CALLS = [("stop44_a", f"{RES}/stop44/a/e2e_stop44a.json", f"{RES}/stop44/a/rows.jsonl"),
         ("stop44_b", f"{RES}/stop44/b/e2e_stop44b.json", f"{RES}/stop44/b/rows.jsonl"),
         # scripts/device/scale_big.sh POINT=128k6 PART=routes
         ("stop44_f", f"{RES}/stop44/f/e2e_big_128k6_routes.json", f"{RES}/stop44/f/rows.jsonl")]
ROUTE = {"gpu": ("gpu", "route gpu"), "auto": ("auto", "split"),
         "cpu": ("auto, KVFERRY_SPLIT_SHARE=1", "all misses on CPU")}


def rows_of(call, e2e, jsonl):
    sdpa = {}
    if os.path.exists(e2e):
        for r in json.load(open(e2e))["rows"]:
            if r.get("sdpa_ms_per_token_step"):
                sdpa[(r["context"], r["batch"])] = r["sdpa_ms_per_token_step"]
    out = []
    for line in open(jsonl):
        r = json.loads(line)
        kind = r["variant"].rsplit("_", 1)[1]
        route, label = ROUTE[kind]
        row = {"policy": r["mode"], "mode": f"{r['mode']} ({label})", "selectors": "none",
               "context": r["context"], "batch": r["batch"], "route": route,
               "gpu_bytes_cap": r.get("gpu_bytes_cap", 8589934592)}
        if "skipped" in r:
            row.update(skipped=r["skipped"], call=call)
            out.append(row)
            continue
        ms = r["ms_per_token_step_no_graph"]
        s = sdpa.get((r["context"], r["batch"]))
        row.update(
            ms_per_token_step=ms, tokens_per_s=round(r["batch"] * 1e3 / ms, 1),
            speedup_vs_full_streaming=None, speedup_vs_dense_cpu=None,
            sdpa_uncapped_ms_per_token_step=s, ratio_vs_sdpa_uncapped=(ms / s if s else None),
            gpu_bytes=r["gpu_bytes"], host_bytes=r["host_bytes"], bank_slots=r["bank_slots"],
            rows_selected_per_step=r["rows_selected_per_step"],
            rows_cpu_per_step=r["rows_cpu_per_step"],
            decode_split_per_step=r["decode_split_per_step"], split_share=r["split_share"],
            cost_cpu_gbps=r["cost_cpu_gbps"], cost_pcie_gbps=r["cost_pcie_gbps"],
            ms_per_token_step_graph=r["ms_per_token_step"],
            host_syncs_per_step=r["host_syncs_per_step_no_graph"], capture_safe=r["capture_safe"],
            stages_ms_per_step=r["stages_ms_per_step"], fill_s=r["fill_s"],
            unique_kv=r["unique_kv"], call=call, variant=r["variant"])
        out.append(row)
    return out


def main():
    new = []
    for call, e2e, jsonl in CALLS:
        new += rows_of(call, e2e, jsonl)
    # Stop 41's call A (128K x 1 and x 4, no SDPA in that call) from split_h100.json's rows.
    label41 = {"gpu": ("gpu", "route gpu"), "split": ("auto", "split"),
               "cpu": ("auto, KVFERRY_SPLIT_SHARE=1", "all misses on CPU")}
    for r in json.load(open(f"{RES}/split_h100.json"))["rows"]:
        route, label = label41[r["route"]]
        new.append({"policy": r["policy"], "mode": f"{r['policy']} ({label})", "selectors": "none",
                    "context": r["context"], "batch": r["batch"], "route": route,
                    "gpu_bytes_cap": 8589934592, "ms_per_token_step": r["ms_per_token_step"],
                    "tokens_per_s": r["tokens_per_s"], "speedup_vs_full_streaming": None,
                    "speedup_vs_dense_cpu": None, "sdpa_uncapped_ms_per_token_step": None,
                    "ratio_vs_sdpa_uncapped": None, "gpu_bytes": r["gpu_bytes"],
                    "rows_selected_per_step": r["rows_selected_per_step"],
                    "rows_cpu_per_step": r["rows_cpu_per_step"],
                    "decode_split_per_step": r["decode_split_per_step"],
                    "cost_cpu_gbps": r["cost_cpu_gbps"], "cost_pcie_gbps": r["cost_pcie_gbps"],
                    "ms_per_token_step_graph": r["ms_per_token_step_graph"], "call": "stop41_a"})
    # Stop 44's call E (scripts/device/scale_big.sh, POINT=128k6 PART=bank,base): 128K x 6, the
    # largest 128K batch the one-GPU kind's host memory holds, with its baselines in the same call.
    big = json.load(open(f"{RES}/stop44/e/e2e_big_128k6_bank_base.json"))["rows"]
    ms_of = {r["mode"]: r["ms_per_token_step"] for r in big}
    for r in big:
        ms = r["ms_per_token_step"]
        new.append({"policy": "kvpop" if r["mode"] == "kvpop_bank" else "dense", "mode": r["mode"],
                    "selectors": "none", "context": r["context"], "batch": r["batch"],
                    "route": "cpu" if r["mode"] == "dense_cpu" else "gpu",
                    "gpu_bytes_cap": r["gpu_bytes_cap"], "ms_per_token_step": ms,
                    "tokens_per_s": round(r["batch"] * 1e3 / ms, 1),
                    "speedup_vs_full_streaming": round(ms_of["full_streaming"] / ms, 2),
                    "speedup_vs_dense_cpu": round(ms_of["dense_cpu"] / ms, 2),
                    "sdpa_uncapped_ms_per_token_step": r["sdpa_ms_per_token_step"],
                    "sdpa_distinct_layer_kv": r["sdpa_distinct_layer_kv"],
                    "ratio_vs_sdpa_uncapped": ms / r["sdpa_ms_per_token_step"],
                    "gpu_bytes": r["gpu_bytes"], "host_bytes": r["host_bytes"],
                    "bank_slots": r["bank_slots"], "bank_hit_rate": r["bank_hit_rate"],
                    "rows_bank_hit_per_step": r["rows_bank_hit_per_step"],
                    "rows_fetched_per_step": r["rows_fetched_per_step"],
                    "rows_cpu_per_step": r["rows_cpu_per_step"],
                    "host_syncs_per_step": r["host_syncs_per_step"],
                    "capture_safe": r["capture_safe"],
                    "ms_per_token_step_no_graph": r["ms_per_token_step_no_graph"],
                    "stages_ms_per_step": r["stages_ms_per_step"], "fill_s": r["fill_s"],
                    "unique_kv": r["unique_kv"], "call": "stop44_e"})
    calls = {c for c, _, _ in CALLS} | {"stop41_a", "stop44_e"}

    path = f"{RES}/scale_h100.json"
    d = json.load(open(path))
    d["rows"] = [r for r in d["rows"] if r.get("call") not in calls] + new
    tag = " Stop 44 (stop44_a"
    if tag not in d["note"]:
        d["note"] += (
            " Stop 44 (stop44_a, stop44_b; H200; keys unique; 2%; no bank; 8 GiB cap; SDPA uncapped"
            " in the same call): the scheduler's split against the single routes for the"
            " device-selecting policies without a bank (sparcas, kvpop), at 32K x 1 / 4 / 16 and"
            " 512K x 1; stop41_a's rows at 128K x 1 and x 4 (split_h100.json; no SDPA in that call, so"
            " their ratio is null; its balanced share came after, in stop41_c). Modes '<policy> (route gpu)',"
            " '(split)' (route auto, the share following the steps) and '(all misses on CPU)'"
            " (KVFERRY_SPLIT_SHARE=1). Their ms_per_token_step is the eager step (a CUDA graph holds"
            " no host work, so a captured step is gpu-only: ms_per_token_step_graph), and"
            " speedup_vs_* are null (the streaming and dense-CPU baselines were not run in those"
            " calls: stop30_a/b's rows hold them at 32K x 4, 32K x 16 and 512K x 1). sparcas at"
            " 512K x 1 is refused by the cap (its compact keys, 6.68 GB, plus one layer's prefill"
            " staging, 2.15 GB, exceed 8 GiB even without the prefill prefetch): the row is the"
            " message. stop44_e (scripts/device/scale_big.sh POINT=128k6 PART=bank,base; H200):"
            " 128K x 6, the largest batch at 128K whose host KV (96 GiB) the one-GPU kind holds"
            " (128K x 16 needs 256 GiB), kvpop_bank under the 8 GiB cap with full_streaming and"
            " dense_cpu in the same call (its speedups are against those) and SDPA uncapped there"
            " (23 distinct layers' KV fit 70 GiB of the GPU; the other 9 layers reread them)."
            " stop44_f (scale_big.sh POINT=128k6 PART=routes): the route rows at 128K x 6.")
    json.dump(d, open(path, "w"), indent=1)

    path = f"{RES}/split_h100.json"
    d = json.load(open(path))
    d["scale_points"] = {
        "what": "stop 44 (scripts/device/stop44_a.sh: 32K x 1, 4, 16; stop44_b.sh: 512K x 1), H200,"
                " 8 GiB cap, keys unique, 2%, no bank, eager steps: route gpu, the split (route"
                " auto, share following the steps) and every miss on the CPU"
                " (KVFERRY_SPLIT_SHARE=1); the same rows are in scale_h100.json",
        "rows": [{k: r.get(k) for k in ("policy", "context", "batch", "route", "mode",
                                         "ms_per_token_step", "ms_per_token_step_graph",
                                         "split_share", "rows_cpu_per_step",
                                         "rows_selected_per_step", "sdpa_uncapped_ms_per_token_step",
                                         "skipped", "call")}
                 for r in new if r["call"] not in ("stop41_a", "stop44_e")]}
    json.dump(d, open(path, "w"), indent=1)

    # The rule: the split never below 0.95x of the better single route.
    pts = {}
    for r in new:
        if "skipped" not in r and "(" in r["mode"]:
            pts.setdefault((r["policy"], r["context"], r["batch"]), {})[r["mode"].split("(")[1][:-1]] = r["ms_per_token_step"]
    for (p, c, b), m in sorted(pts.items(), key=lambda x: (x[0][1], x[0][2], x[0][0])):
        best = min(m["route gpu"], m["all misses on CPU"])
        print(f"{p:8s} {c // 1024:4d}K x{b:<3d} gpu {m['route gpu']:8.3f}  cpu {m['all misses on CPU']:8.3f}"
              f"  split {m['split']:8.3f}  split vs better {best / m['split']:.3f}x")


if __name__ == "__main__":
    main()
