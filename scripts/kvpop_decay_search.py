#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Chooses KVpop's decay per group of layers by decoding, not by a proxy (docs/policies.md, kvpop).

A trained scorer (scripts/kvpop_train.py) ranks a token when it leaves the window by its static
priority p_u = r_u - u log(gamma_h). With gamma at the smallest value the file allows (0.01 here:
one position of age outweighs any score) the slots hold the most recent tokens and KVpop equals
streaming at the same budget exactly. On SmolLM2 the scorer's choices lose to that in some layers
and win in others, and neither the attention mass nor the top-k recall they keep in a
teacher-forced replay tells which (docs/policies.md). So this script decodes:

1. screen: from recency everywhere (= streaming), each group of layers alone at each decay of
   --grid, every candidate's perplexity on the training windows (--text) in parallel;
2. combine: the groups whose best decay lowered the mean log perplexity by more than --tol, sorted
   by gain; each prefix of that list combined (in parallel), and the best prefix kept.
The result is the scorer file with alpha set to each layer's decay (recency where the scorer does
not pay) and gamma_min/gamma_max metadata spanning [0.01, --gamma-max]. The texts must be windows
the quality runs do not score; a held-out text checks the choice. Plain Python (no torch): the
perplexity runs are kvferry-llama processes, --parallel of them at a time.

  python3 scripts/kvpop_decay_search.py --weights W --out OUT --text data/kjv.txt:20000 \\
      data/jargon.txt:2000 --groups 0 1-2 3-10 11-19 20-29 --report R.json --parallel 16
"""
import argparse
import json
import math
import os
import struct
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

RECENCY = 0.01
PAPER = (0.999, 0.999999)  # the paper's decay range (notes/kvpop.md); alpha 0 is its midpoint


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    return head, data


def write_weights(src, dst, decays, gamma_max, gamma_min=RECENCY):
    """src's scorer with alpha [layers, kv_heads] set so that layer l's decay is decays[l] over
    [gamma_min, gamma_max] (log gamma = lo + sigmoid(alpha) (hi - lo), policies/kvpop/kvpop.h);
    decays None: alpha 0 (the midpoint)."""
    head, data = read_safetensors(src)
    a = head["alpha"]
    assert a["dtype"] == "F32" and len(a["shape"]) == 2, "alpha must be F32 [layers, kv_heads]"
    L, H = a["shape"]
    assert decays is None or len(decays) == L, f"{len(decays)} decays for {L} layers"
    lo, hi = math.log(gamma_min), math.log(gamma_max)
    vals = []
    for g in decays if decays is not None else [math.exp((lo + hi) / 2)] * L:
        frac = min(max((math.log(g) - lo) / (hi - lo), 1e-7), 1 - 1e-7)
        vals += [math.log(frac / (1 - frac))] * H
    b, e = a["data_offsets"]
    data = data[:b] + struct.pack(f"<{L * H}f", *vals) + data[e:]
    meta = dict(head.get("__metadata__", {}))
    meta.update({"gamma_min": repr(gamma_min), "gamma_max": repr(gamma_max)})
    if decays is None:
        meta["decay"] = "alpha 0 (the paper's range; the pair loss does not move it)"
        meta.pop("layer_decays", None)
    else:
        meta.update({"decay": "per layer, chosen by decoding (scripts/kvpop_decay_search.py)",
                     "layer_decays": ",".join(repr(x) for x in decays)})
    head["__metadata__"] = meta
    hb = json.dumps(head, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + data)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="trained scorer (scripts/kvpop_train.py)")
    ap.add_argument("--out", help="the scorer with the chosen decays")
    ap.add_argument("--paper-out", help="only write the scorer at the paper's decay (alpha 0 over [0.999, "
                                        "0.999999], as the pair loss leaves it) to this file, and exit")
    ap.add_argument("--report", help="JSON: every evaluation and the choice")
    ap.add_argument("--text", nargs="+", help="FILE:OFFSET_LINES training windows")
    ap.add_argument("--groups", nargs="+", help="layer ranges a-b (or one layer)")
    ap.add_argument("--grid", type=float, nargs="+", default=[0.995, 0.998, 0.9995])
    ap.add_argument("--gamma-max", type=float, default=0.999999)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--scored", type=int, default=1024)
    ap.add_argument("--tol", type=float, default=0.002, help="relative perplexity gain a group needs")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--llama", default=os.path.join(os.environ.get("B", "build-release"), "examples/llama/kvferry-llama"))
    ap.add_argument("--model", default="data/SmolLM2-135M-Instruct.Q4_1.gguf")
    args = ap.parse_args()
    if args.paper_out:
        write_weights(args.weights, args.paper_out, None, PAPER[1], PAPER[0])
        return
    if not (args.out and args.text and args.groups):
        ap.error("--out, --text and --groups are needed for the search")
    L = read_safetensors(args.weights)[0]["alpha"]["shape"][0]
    groups = [tuple(int(x) for x in g.split("-")) if "-" in g else (int(g), int(g)) for g in args.groups]
    t0 = time.time()
    evals = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        def run(job):
            w, text, out = job
            path, off = text.rsplit(":", 1)
            subprocess.run([args.llama, "--model", args.model, "--perplexity", "--backend", "host", "--text", path,
                            "--offset-lines", off, "--context", str(args.context), "--scored", str(args.scored),
                            "--cpu-threads", "1", "--policy-weights", w, "--policy", "kvpop", "--budget",
                            str(args.budget), "--no-dense", "--json", out],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(out) as f:
                return json.load(f)["lanes"][0]["perplexity"]

        def score_all(cands):  # [(tag, decays)] -> objectives, all runs in parallel
            jobs = []
            for i, (tag, decays) in enumerate(cands):
                w = os.path.join(tmp, f"w{len(evals) + i}.safetensors")
                write_weights(args.weights, w, decays, args.gamma_max)
                jobs += [(w, t, os.path.join(tmp, f"p{len(evals) + i}_{j}.json")) for j, t in enumerate(args.text)]
            ppl = list(pool.map(run, jobs))
            objs = []
            for i, (tag, decays) in enumerate(cands):
                p = ppl[i * len(args.text):(i + 1) * len(args.text)]
                obj = sum(math.log(x) for x in p) / len(p)
                evals.append({"tag": tag, "decays": list(decays), "perplexity": dict(zip(args.text, p)),
                              "objective": obj})
                print(f"{tag:30s} " + " ".join(f"{x:.4f}" for x in p) + f"  obj {obj:.5f}", flush=True)
                objs.append(obj)
            print(f"({time.time() - t0:.0f} s)", flush=True)
            return objs

        base = [RECENCY] * L
        cands = [("recency (= streaming)", base)]
        for a, b in groups:
            for g in args.grid:
                cands.append((f"layers {a}-{b} gamma {g}", [g if a <= l <= b else RECENCY for l in range(L)]))
        objs = score_all(cands)
        base_obj = objs[0]
        gains = []  # (gain, group, gamma)
        for gi, (a, b) in enumerate(groups):
            row = objs[1 + gi * len(args.grid): 1 + (gi + 1) * len(args.grid)]
            j = min(range(len(row)), key=row.__getitem__)
            if row[j] < base_obj + math.log(1 - args.tol):
                gains.append((base_obj - row[j], (a, b), args.grid[j]))
        gains.sort(reverse=True)
        best, best_obj = base, base_obj
        if gains:
            prefixes = []
            cur = list(base)
            for n, (_, (a, b), g) in enumerate(gains):
                for l in range(a, b + 1):
                    cur[l] = g
                prefixes.append((f"best {n + 1} group(s) combined", list(cur)))
            pobjs = score_all(prefixes[1:]) if len(prefixes) > 1 else []
            pobjs = [base_obj - gains[0][0]] + pobjs
            k = min(range(len(pobjs)), key=pobjs.__getitem__)
            best, best_obj = prefixes[k][1], pobjs[k]
        write_weights(args.weights, args.out, best, args.gamma_max)
    print(f"chosen decays per layer: {best} (objective {best_obj:.5f}, recency {base_obj:.5f}) -> {args.out}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"args": vars(args), "evaluations": evals, "chosen_decays": best, "objective": best_obj,
                       "recency_objective": base_obj, "seconds": time.time() - t0}, f, indent=1)


if __name__ == "__main__":
    main()
