#!/usr/bin/env python3
"""Adds stop 44's rows to the scale table (bench/results/scale_h100.json) and its route rows to
the split file (bench/results/split_h100.json's scale_points); prints the route rule's check.

Sources: the route rows of stop44_a.sh (32K x 1 / 4 / 16), stop44_b.sh (512K x 1) and
scale_big.sh POINT=128k6 PART=routes (call F), each with torch SDPA uncapped in the same call;
stop 41's call A (128K x 1 / 4, split_h100.json's rows, no SDPA in that call); and
scale_big.sh POINT=128k6 PART=bank,base (call E: kvpop_bank with full_streaming and dense_cpu in
the same call). A route row's ms_per_token_step is the eager step (a step captured in a CUDA graph
holds no host work, so it is gpu-only whatever the route; its time is ms_per_token_step_graph).
Usage: python3 scripts/device/stop44_merge.py   (from the repository root; idempotent)
"""
import json

RES = "bench/results"
CAP = 8589934592
ROUTE_CALLS = [("stop44_a", f"{RES}/stop44/a/e2e_stop44a.json"),
               ("stop44_b", f"{RES}/stop44/b/e2e_stop44b.json"),
               ("stop44_f", f"{RES}/stop44/f/e2e_big_128k6_routes.json")]
BASE_CALL = ("stop44_e", f"{RES}/stop44/e/e2e_big_128k6_bank_base.json")
# The variant's suffix (stop 44) or split_h100.json's route (stop 41) -> (route, mode label).
ROUTES = {"gpu": ("gpu", "route gpu"), "auto": ("auto", "split"), "split": ("auto", "split"),
          "cpu": ("auto, KVFERRY_SPLIT_SHARE=1", "all misses on CPU")}
# Fields a scale row carries over from its source row when it has them.
KEEP = ("gpu_bytes", "host_bytes", "bank_slots", "bank_hit_rate", "rows_selected_per_step",
        "rows_bank_hit_per_step", "rows_fetched_per_step", "rows_cpu_per_step",
        "decode_split_per_step", "split_share", "cost_cpu_gbps", "cost_pcie_gbps",
        "host_syncs_per_step", "capture_safe", "stages_ms_per_step", "fill_s", "unique_kv", "sdpa_distinct_layer_kv",
        "ms_per_token_step_graph", "variant")
NOTE = (
    " Stop 44 (stop44_a, stop44_b, and scale_big.sh POINT=128k6 PART=routes as stop44_f; H200;"
    " keys unique; 2%; no bank; 8 GiB cap; SDPA uncapped in the same call): the scheduler's split"
    " against the single routes for the device-selecting policies without a bank (sparcas, kvpop),"
    " at 32K x 1 / 4 / 16, 128K x 6 and 512K x 1; stop41_a's rows at 128K x 1 and x 4"
    " (split_h100.json; no SDPA in that call, so their ratio is null; its balanced share came"
    " after, in stop41_c). Modes '<policy> (route gpu)', '(split)' (route auto, the share following"
    " the steps) and '(all misses on CPU)' (KVFERRY_SPLIT_SHARE=1). Their ms_per_token_step is the"
    " eager step (a CUDA graph holds no host work, so a captured step is gpu-only:"
    " ms_per_token_step_graph), and speedup_vs_* are null (the streaming and dense-CPU baselines"
    " were not run in those calls: stop30_a/b's rows hold them at 32K x 4, 32K x 16 and 512K x 1)."
    " sparcas at 512K x 1 is refused by the cap (its compact keys, 6.68 GB, plus one layer's"
    " prefill staging, 2.15 GB, exceed 8 GiB even without the prefill prefetch): the row is the"
    " message. stop44_e (scripts/device/scale_big.sh POINT=128k6 PART=bank,base; H200): 128K x 6,"
    " the largest batch at 128K whose host KV (96 GiB) the one-GPU kind holds (128K x 16 needs"
    " 256 GiB), kvpop_bank under the 8 GiB cap with full_streaming and dense_cpu in the same call"
    " (its speedups are against those) and SDPA uncapped there (23 distinct layers' KV fit 70 GiB"
    " of the GPU; the other 9 layers reread them).")


def scale_row(r, call, policy, mode, route, ms, sdpa=None, base=None):
    """One row of scale_h100.json with the issue's fields, from a kvferry-e2e row r."""
    row = {"policy": policy, "mode": mode, "selectors": "none", "context": r["context"],
           "batch": r["batch"], "route": route, "gpu_bytes_cap": r.get("gpu_bytes_cap", CAP)}
    if "skipped" in r:
        return {**row, "skipped": r["skipped"], "call": call}
    row.update(ms_per_token_step=ms, tokens_per_s=round(r["batch"] * 1e3 / ms, 1),
               speedup_vs_full_streaming=round(base["full_streaming"] / ms, 2) if base else None,
               speedup_vs_dense_cpu=round(base["dense_cpu"] / ms, 2) if base else None,
               sdpa_uncapped_ms_per_token_step=sdpa,
               ratio_vs_sdpa_uncapped=ms / sdpa if sdpa else None)
    row.update({k: r[k] for k in KEEP if k in r})
    row["call"] = call
    return row


def route_row(r, call, kind, ms, sdpa=None):
    route, label = ROUTES[kind]
    return scale_row(r, call, r["policy"], f"{r['policy']} ({label})", route, ms, sdpa)


def main():
    new = []
    for call, path in ROUTE_CALLS:
        for r in json.load(open(path))["rows"]:
            # The eager step; the graph's kept beside it.
            r = {**r, "policy": r["mode"], "ms_per_token_step_graph": r.get("ms_per_token_step"),
                 "host_syncs_per_step": r.get("host_syncs_per_step_no_graph")}
            new.append(route_row(r, call, r["variant"].rsplit("_", 1)[1],
                                 r.get("ms_per_token_step_no_graph"), r.get("sdpa_ms_per_token_step")))
    for r in json.load(open(f"{RES}/split_h100.json"))["rows"]:
        new.append(route_row(r, "stop41_a", r["route"], r["ms_per_token_step"]))
    call, path = BASE_CALL
    big = json.load(open(path))["rows"]
    base = {r["mode"]: r["ms_per_token_step"] for r in big}
    for r in big:
        new.append({**scale_row(r, call, "kvpop" if r["mode"] == "kvpop_bank" else "dense",
                                 r["mode"], "cpu" if r["mode"] == "dense_cpu" else "gpu",
                                 r["ms_per_token_step"], r["sdpa_ms_per_token_step"], base),
                    "ms_per_token_step_no_graph": r["ms_per_token_step_no_graph"]})
    calls = {c for c, _ in ROUTE_CALLS} | {"stop41_a", call}

    path = f"{RES}/scale_h100.json"
    d = json.load(open(path))
    d["rows"] = [r for r in d["rows"] if r.get("call") not in calls] + new
    d["note"] = d["note"].split(" Stop 44 (")[0] + NOTE
    json.dump(d, open(path, "w"), indent=1)

    routes = [r for r in new if r["call"] in {c for c, _ in ROUTE_CALLS}]
    path = f"{RES}/split_h100.json"
    d = json.load(open(path))
    d["scale_points"] = {
        "what": "stop 44 (scripts/device/stop44_a.sh: 32K x 1, 4, 16; stop44_b.sh: 512K x 1;"
                " scale_big.sh POINT=128k6 PART=routes: 128K x 6), H200, 8 GiB cap, keys unique,"
                " 2%, no bank, eager steps: route gpu, the split (route auto, share following the"
                " steps) and every miss on the CPU (KVFERRY_SPLIT_SHARE=1); the same rows are in"
                " scale_h100.json",
        "rows": [{k: r.get(k) for k in ("policy", "context", "batch", "route", "mode",
                                         "ms_per_token_step", "ms_per_token_step_graph",
                                         "split_share", "rows_cpu_per_step",
                                         "rows_selected_per_step", "sdpa_uncapped_ms_per_token_step",
                                         "skipped", "call")}
                 for r in routes]}
    json.dump(d, open(path, "w"), indent=1)

    # The rule: the split never below 0.95x of the better single route.
    pts = {}
    for r in new:
        if "skipped" not in r and "(" in r["mode"]:
            label = r["mode"].split("(")[1][:-1]
            pts.setdefault((r["policy"], r["context"], r["batch"]), {})[label] = r["ms_per_token_step"]
    for (p, c, b), m in sorted(pts.items(), key=lambda x: (x[0][1], x[0][2], x[0][0])):
        gpu, cpu, split = m["route gpu"], m["all misses on CPU"], m["split"]
        print(f"{p:8s} {c // 1024:4d}K x{b:<3d} gpu {gpu:8.3f}  cpu {cpu:8.3f}  split {split:8.3f}"
              f"  split vs better {min(gpu, cpu) / split:.3f}x")


if __name__ == "__main__":
    main()
