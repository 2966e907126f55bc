#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Merges kvferry-llama perplexity / passkey JSON and kvferry-bench trace-replay JSONL into one
quality table (bench/results/quality_smollm2.json): per policy and budget, perplexity and its gap
to dense (and over the oracle's gap at the same budget), passkey found/total and whether it is
found whenever dense finds it, and recall / mass_recall / rel_err on real traces.

  python scripts/quality_smollm2.py --ppl a.json b.json@bits=16,d_b=8 --passkey p.json q.json \
      --replay r.jsonl --out bench/results/quality_smollm2.json --note "..."
A perplexity file named with "@k=v,..." ran its policies with those parameters: its rows are the
policy's variant (its "params"), beside the defaults' rows (params {}). Later files win when a lane
of the same parameters appears twice.
"""
import argparse
import json


def lane_key(label):
    """(policy, budget, params) of a lane label "name[:k=v...][@budget]" (kvferry-llama --policy)."""
    p, b = label.split("@") if "@" in label else (label, None)
    name, *parts = p.split(":")
    params = {k: float(v) for k, v in (kv.split("=") for kv in parts)}
    return name, int(b) if b is not None else None, params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ppl", nargs="*", default=[])
    ap.add_argument("--passkey", nargs="*", default=[])
    ap.add_argument("--replay", nargs="*", default=[])
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("--no-plot", action="store_true", help="skip bench/plot.py's quality plot")
    a = ap.parse_args()

    rows = {}
    def row(policy, budget, params=None):
        params = params or {}
        key = (f"{policy}@{budget}" if budget else policy) + "".join(f" {k}={v:g}" for k, v in params.items())
        return rows.setdefault(key, {"policy": policy, "budget": budget, "params": dict(params)})

    for spec in a.ppl:
        path, _, ps = spec.partition("@")
        params = {k: float(v) for k, v in (kv.split("=") for kv in ps.split(",") if kv)}
        d = json.load(open(path))
        for l in d["lanes"]:
            p, b, lp = lane_key(l["lane"])
            r = row(p, b, {**params, **lp} if p != "dense" else None)
            r["perplexity"] = l["perplexity"]
            r["argmax_agree_with_lane0"] = l["argmax_agree"]
            r["decode_seconds"] = l["decode_seconds"]
            st = l.get("stats", {})
            if st.get("decode_steps"):
                r["ms_select_per_layer_step"] = st["ms_select"] / st["decode_steps"]
    dense = rows.get("dense", {}).get("perplexity")
    if dense:
        for r in rows.values():
            if "perplexity" in r:
                r["gap_pct"] = 100.0 * (r["perplexity"] / dense - 1)
        for r in rows.values():
            o = rows.get(f"oracle@{r['budget']}")
            if r["budget"] and o and o.get("gap_pct") and "gap_pct" in r:
                r["gap_over_oracle_gap"] = r["gap_pct"] / o["gap_pct"]

    # Passkey: per trial, which lanes found the key; dense's answer decides "whenever dense does".
    trials = {}
    for path in a.passkey:
        d = json.load(open(path))
        for t in d["trials"]:
            k = (t["length"], t["depth"], t["key"])
            trials.setdefault(k, {}).update({lab: v["found"] for lab, v in t["answers"].items()})
    for (length, depth, key), ans in sorted(trials.items()):
        for lab, found in ans.items():
            p, b, lp = lane_key(lab)
            r = row(p, b, lp)
            pk = r.setdefault("passkey", {"found": 0, "trials": 0, "missed_where_dense_found": 0,
                                          "by_prompt": []})
            pk["trials"] += 1
            pk["found"] += int(found)
            if ans.get("dense") and not found:
                pk["missed_where_dense_found"] += 1
            pk["by_prompt"].append({"length": length, "depth": depth, "found": found})
    for r in rows.values():
        pk = r.get("passkey")
        if pk and "dense" in rows:
            pk["found_whenever_dense_does"] = pk["missed_where_dense_found"] == 0

    for path in a.replay:
        for line in open(path):
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            tag = d.get("tag") or d["policy"]
            r = row(tag, d["budget"] if d["policy"] != "dense" else None)
            r["trace_replay"] = {k: d[k] for k in ("recall", "mass_recall", "rel_err", "rel_err_max",
                                                   "steps", "layers", "context", "workload")
                                 if k in d}

    out = {"bench": "quality_smollm2", "notes": a.note, "sources": {"perplexity": a.ppl,
           "passkey": a.passkey, "replay": a.replay},
           "rows": [rows[k] for k in sorted(rows, key=lambda k: (rows[k]["budget"] or 0, k))]}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    # The plot next to it (bench/plot.py; skipped with a message without matplotlib).
    if not a.no_plot:
        import os
        import subprocess
        import sys
        plot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "plot.py")
        subprocess.call([sys.executable, plot, "--results", os.path.dirname(os.path.abspath(a.out)),
                         "--only", "quality"])
    for r in out["rows"]:
        pk = r.get("passkey", {})
        tr = r.get("trace_replay", {})
        ps = ",".join(f"{k}={v:g}" for k, v in r["params"].items())
        print(f"{r['policy']:>10} {str(r['budget'] or ''):>4} {ps:>14} ppl {r.get('perplexity', float('nan')):7.3f} "
              f"gap {r.get('gap_pct', float('nan')):6.2f}% x{r.get('gap_over_oracle_gap', float('nan')):5.2f} "
              f"passkey {pk.get('found', '-')}/{pk.get('trials', '-')} "
              f"recall {tr.get('recall', float('nan')):.3f} mass {tr.get('mass_recall', float('nan')):.3f} "
              f"rel_err {tr.get('rel_err', float('nan')):.3f}")


if __name__ == "__main__":
    main()
