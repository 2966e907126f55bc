#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""The decode query model of kvferry-e2e, calibrated to real decoding.

A real decode query moves from step to step: the exact top-k of one step shares part of its
tokens with the next step's, less with one further away, and some tokens (heavy hitters) stay
for good. kvferry-e2e's moving query (--query-drift E --query-rho R) is

    q_s = q_0 + E z_s,   z_s = R z_(s-1) + sqrt(1 - R^2) n_s,   n_s fresh noise at every step,

an anchor q_0 (what stays) plus a stationary AR(1) walk (what moves; R sets how fast). This
script measures, for the exact top-k (the oracle's selection: the group's softmax weights summed,
top-k of the offloaded positions, k a fraction of them), the share of step t's top-k that was in
step t - L's, for lags L:

  traces     on recorded SmolLM2 decode traces (kvferry-llama --dump-trace), every layer and KV head
  synthetic  on kvferry-e2e's own keys and query (the same generators, reimplemented with numpy)
             for a grid of (E, R)
  fit        picks the (E, R) whose overlap curve is nearest the traces' mean

  python3 bench/query_calibration.py traces --trace kjv=T1.safetensors --trace jargon=T2.safetensors --json OUT
  python3 bench/query_calibration.py synthetic --context 32768 --json OUT
  python3 bench/query_calibration.py fit TRACES.json SYNTHETIC.json
Needs numpy. bench/reproduce.py query_calibration runs the three with the token bank's hit rates.
"""
import argparse
import json
import math
import struct
import sys

import numpy as np

LAGS = (1, 2, 4, 8, 16, 32)
FRACTION = 0.018  # k / offloaded positions: kvferry-e2e's 2% budget at 128K (2361 of 130812)


def topk_sets(q, k, n_list, sink, window, frac, group):
    """q: [T, Hq, D] f32, k: [T, Hkv, D] f32. For each n in n_list (the step sees keys 0..n-1 and
    the query of position n-1): per KV head the set of the top-k offloaded positions by the group's
    summed softmax weights."""
    hkv, d = k.shape[1], k.shape[2]
    out = []
    for n in n_list:
        lo, hi = sink, n - window
        kk = max(1, int(round(frac * (hi - lo))))
        sets = []
        for h in range(hkv):
            qh = q[n - 1, h * group:(h + 1) * group, :]  # [group, D]
            logits = (k[:n, h, :] @ qh.T) / math.sqrt(d)  # [n, group]
            logits -= logits.max(axis=0, keepdims=True)
            w = np.exp(logits)
            w /= w.sum(axis=0, keepdims=True)
            s = w.sum(axis=1)[lo:hi]
            idx = np.argpartition(-s, kk - 1)[:kk] + lo
            sets.append(set(idx.tolist()))
        out.append(sets)
    return out


def overlaps(sets_by_step):
    """Mean |S_t & S_(t-L)| / |S_t| over steps and heads, per lag."""
    res = {}
    for lag in LAGS:
        vals = [len(a & b) / len(a) for t in range(lag, len(sets_by_step))
                for a, b in zip(sets_by_step[t], sets_by_step[t - lag])]
        if vals:
            res[lag] = float(np.mean(vals))
    return res


def read_safetensors(path, names):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name in names:
            e = head[name]
            assert e["dtype"] == "BF16", e["dtype"]
            a, b = e["data_offsets"]
            f.seek(base + a)
            raw = np.frombuffer(f.read(b - a), dtype=np.uint16)
            out[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(e["shape"])
        return head["__metadata__"], out


def cmd_traces(a):
    rows = []
    for spec in a.trace:
        text, path = spec.split("=", 1)
        meta, _ = read_safetensors(path, [])
        layers = [int(x) for x in meta["layers"].split(",")]
        group = int(meta["num_q_heads"]) // int(meta["num_kv_heads"])
        for layer in layers:
            _, t = read_safetensors(path, [f"layer.{layer}.q", f"layer.{layer}.k"])
            q, k = t[f"layer.{layer}.q"], t[f"layer.{layer}.k"]
            T = q.shape[0]
            n_list = list(range(T - a.steps + 1, T + 1))
            ov = overlaps(topk_sets(q, k, n_list, a.sink, a.window, a.fraction, group))
            rows.append({"text": text, "layer": layer, "context": T, "steps": a.steps,
                         "overlap": {str(l): round(v, 4) for l, v in ov.items()}})
            print(text, layer, " ".join(f"L{l}:{v:.3f}" for l, v in ov.items()), flush=True)
    mean = {str(l): round(float(np.mean([r["overlap"][str(l)] for r in rows])), 4) for l in LAGS}
    per_text = {t: {str(l): round(float(np.mean([r["overlap"][str(l)] for r in rows if r["text"] == t])), 4)
                    for l in LAGS} for t in sorted({r["text"] for r in rows})}
    d = {"what": "share of the exact top-k of step t that was in step t - L's, recorded SmolLM2 traces",
         "fraction": a.fraction, "sink": a.sink, "window": a.window, "mean": mean, "per_text": per_text,
         "rows": rows}
    json.dump(d, open(a.json, "w"), indent=1)
    print("mean", mean)


# ---- kvferry-e2e's generators (bench/e2e_bench.cu FillBf16, DriftBf16) --------------------------
def fill_bf16(n, seed):
    i = np.arange(n, dtype=np.uint64)
    h = ((i * np.uint64(2654435761)) & np.uint64(0xffffffff)) ^ np.uint64(seed)
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(2246822519)) & np.uint64(0xffffffff)
    h ^= h >> np.uint64(13)
    f = ((h & np.uint64(0xffff)).astype(np.float32) / 65536.0 - 0.5) * 4.0
    return ((f.view(np.uint32) >> 16) << 16).view(np.float32)  # truncated to bf16, as the kernel


def to_bf16(x):
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7fff + ((b >> 16) & 1)) >> 16
    return (b.astype(np.uint32) << 16).view(np.float32)


HQ, HKV, D, SINK, WINDOW, CHUNK, PRIME = 32, 8, 128, 4, 256, 4096, 32


def e2e_keys(ctx, layer=0, layers=32, b=0):
    """The keys kvferry-e2e --unique-kv appends for sequence b, layer l (the prime's rows aside)."""
    ks = []
    for pos in range(0, ctx - PRIME, CHUNK):
        n = min(CHUNK, ctx - PRIME - pos)
        ks.append(fill_bf16(n * HKV * D, 7919 + (b * layers + layer) * 1031 + pos // CHUNK).reshape(n, HKV, D))
    ks.append(ks[-1][:PRIME])
    return np.concatenate(ks)


def e2e_queries(steps, drift, rho, seed0=1000):
    """q_s of kvferry-e2e's moving query (batch 1): the anchor plus drift times the AR(1) walk."""
    q0 = fill_bf16(HQ * D, 4).reshape(HQ, D)
    z = fill_bf16(HQ * D, seed0).reshape(HQ, D)
    out = []
    c = math.sqrt(max(0.0, 1 - rho * rho))
    for s in range(steps):
        if s:
            z = rho * z + c * fill_bf16(HQ * D, seed0 + s).reshape(HQ, D)
        out.append(to_bf16(q0 + drift * z))
    return np.stack(out)


def cmd_synthetic(a):
    k = e2e_keys(a.context)
    heads = list(range(a.heads))
    k = k[:, heads, :]
    grid = []
    for drift in [float(x) for x in a.drifts.split(",")]:
        for rho in [float(x) for x in a.rhos.split(",")]:
            if drift == 0 and rho:
                continue
            qs = e2e_queries(a.steps, drift, rho)
            qfull = np.zeros((a.context, HQ, D), np.float32)
            sets = []
            for s in range(a.steps):
                qfull[a.context - 1] = qs[s]
                sets.append(topk_sets(qfull[:, :len(heads) * 4], k, [a.context], SINK, WINDOW, a.fraction, 4)[0])
            ov = overlaps(sets)
            grid.append({"drift": drift, "rho": rho, "overlap": {str(l): round(v, 4) for l, v in ov.items()}})
            print(f"E {drift} R {rho}", " ".join(f"L{l}:{v:.3f}" for l, v in ov.items()), flush=True)
    json.dump({"what": "share of the exact top-k of step t that was in step t - L's, kvferry-e2e's keys "
                       "and moving query", "context": a.context, "kv_heads": len(heads), "fraction": a.fraction,
               "grid": grid}, open(a.json, "w"), indent=1)


def fit(traces, synth):
    target = traces["mean"]
    best = None
    for g in synth["grid"]:
        err = math.sqrt(np.mean([(g["overlap"][l] - target[l]) ** 2 for l in target if l in g["overlap"]]))
        if best is None or err < best[0]:
            best = (err, g)
    return best


def cmd_fit(a):
    err, g = fit(json.load(open(a.traces)), json.load(open(a.synthetic)))
    print(json.dumps({"drift": g["drift"], "rho": g["rho"], "rms_error": round(err, 4), "overlap": g["overlap"]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("traces")
    t.add_argument("--trace", action="append", required=True, help="TEXT=FILE.safetensors")
    t.add_argument("--steps", type=int, default=64)
    t.add_argument("--sink", type=int, default=4)
    t.add_argument("--window", type=int, default=64)
    t.add_argument("--fraction", type=float, default=FRACTION)
    t.add_argument("--json", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("--context", type=int, default=32768)
    s.add_argument("--heads", type=int, default=8)
    s.add_argument("--steps", type=int, default=48)
    s.add_argument("--drifts", default="0.1,0.2,0.3,0.5,0.7,1.0")
    s.add_argument("--rhos", default="0,0.5,0.8,0.9,0.95")
    s.add_argument("--fraction", type=float, default=FRACTION)
    s.add_argument("--json", required=True)
    f = sub.add_parser("fit")
    f.add_argument("traces")
    f.add_argument("synthetic")
    a = ap.parse_args()
    return {"traces": cmd_traces, "synthetic": cmd_synthetic, "fit": cmd_fit}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
