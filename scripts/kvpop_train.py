#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Trains KVpop's MLP scorer (seed 004, notes/kvpop.md) on kvferry-llama attention traces.

The backbone is frozen (we only have its traces): one small MLP per (layer, KV head) scores a
token from its stored [k; v] when it leaves the window, and a learned decay gamma_h turns the score
into the static priority p_t = r_t - t log(gamma_h). Training follows the paper's scorer loss:

* target: the future attention mass a token receives after it leaves the window,
  m_t = (1/N_t) sum_{d >= t + w} exp(scale q_d . k_t - LSE_d), N_t = max(1, S - t - w), with the
  dense LSE of every query computed block by block (no S x S matrix is ever held), the same
  transposed pass for the sum; r_tgt = max over the GQA group of log(eps + m_t);
* teacher at step q: the top-k of the eligible tokens [s, q - w] by p_tgt = r_tgt - t log(gamma_h)
  (the same gamma_h, detached); the new token u = q - w is kept iff it beats the k-th best of the
  others (the boundary token b);
* loss: omega * softplus(-y (p_u - p_b) / tau), y = +1 if kept, omega = margin weight
  (omega_min + (1 - omega_min) sigmoid(|Delta| / tau_omega)) x class-balance weight (clipped, mean 1).

Inputs: traces written by `kvferry-llama --dump-trace FILE --trace-layers all` (safetensors with
layer.L.q [S, Hq, D], layer.L.k / layer.L.v [S, Hkv, D], post-RoPE). Output: a safetensors file
with F32 w1 [L, Hkv, hidden, 2D], b1, w2 [L, Hkv, hidden], b2, alpha [L, Hkv] (input
standardisation folded into w1/b1), read by policies/kvpop/kvpop.cpp (PolicyConfig::weights_path; kvferry-llama --policy-weights FILE).

Example:
  python scripts/kvpop_train.py --train /tmp/q13/train_kjv.safetensors \
      /tmp/q13/train_jargon.safetensors --val /tmp/q13/val_kjv.safetensors \
      --out policies/weights/kvpop_smollm2.safetensors --report /tmp/q13/kvpop_train.json
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def load_trace(path):
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    t = load_file(path)
    layers = [int(x) for x in meta["layers"].split(",")]
    tr = {"meta": meta, "path": path, "layers": layers, "q": [], "k": [], "v": []}
    for l in layers:
        tr["q"].append(t[f"layer.{l}.q"].float())
        tr["k"].append(t[f"layer.{l}.k"].float())
        tr["v"].append(t[f"layer.{l}.v"].float())
    return tr


@torch.no_grad()
def future_targets(q, k, window, eps, block=512):
    """log(eps + m_t) per KV head, max over the group: q [S, Hq, D], k [S, Hkv, D] -> [S, Hkv].

    Two block passes over S: the dense LSE of every query, then the transposed pass (keys as
    queries) summing exp(logit - LSE_d) over the future queries d >= t + window.
    """
    S, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    kk = k.repeat_interleave(g, dim=1)  # [S, Hq, D]
    pos = torch.arange(S)
    lse = torch.empty(S, hq)
    for a in range(0, S, block):
        b = min(S, a + block)
        logits = torch.einsum("qhd,shd->hqs", q[a:b], kk) * scale  # [Hq, bq, S]
        logits.masked_fill_((pos[None, :] > pos[a:b, None])[None], float("-inf"))
        lse[a:b] = torch.logsumexp(logits, -1).T
    log_m = torch.empty(S, hq)
    for a in range(0, S, block):
        b = min(S, a + block)
        logits = torch.einsum("shd,qhd->hsq", kk[a:b], q) * scale - lse.T[:, None, :]  # [Hq, bk, S]
        logits.masked_fill_((pos[None, :] < pos[a:b, None] + window)[None], float("-inf"))
        log_m[a:b] = torch.logsumexp(logits, -1).T
    n_t = torch.clamp(S - pos - window, min=1).float()
    log_m = log_m - torch.log(n_t)[:, None]
    r = torch.logaddexp(log_m, torch.full_like(log_m, math.log(eps)))  # log(eps + m)
    return r.view(S, hkv, g).amax(-1), n_t


class Scorer(torch.nn.Module):
    def __init__(self, layers, heads, in_dim, hidden, mu, sd):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(layers, heads, hidden, in_dim) / math.sqrt(in_dim))
        self.b1 = torch.nn.Parameter(torch.zeros(layers, heads, hidden))
        self.w2 = torch.nn.Parameter(torch.zeros(layers, heads, hidden))  # neutral start = recency
        self.b2 = torch.nn.Parameter(torch.zeros(layers, heads))
        self.alpha = torch.nn.Parameter(torch.zeros(layers, heads))
        self.register_buffer("mu", mu)  # [L, H, in]
        self.register_buffer("sd", sd)

    def scores(self, l, x):  # x [S, H, in] -> r [S, H]
        xs = (x - self.mu[l]) / self.sd[l]
        h = F.silu(torch.einsum("shi,hji->shj", xs, self.w1[l]) + self.b1[l])
        return torch.einsum("shj,hj->sh", h, self.w2[l]) + self.b2[l]

    def log_gamma(self, l, gmin, gmax):
        lo, hi = math.log(gmin), math.log(gmax)
        return lo + torch.sigmoid(self.alpha[l]) * (hi - lo)

    def export(self):
        """Weights with the standardisation folded in: w1' = w1 / sd, b1' = b1 - w1' mu."""
        w1 = self.w1.detach() / self.sd[:, :, None, :]
        b1 = self.b1.detach() - torch.einsum("lhji,lhi->lhj", w1, self.mu)
        return {"w1": w1.contiguous(), "b1": b1.contiguous(), "w2": self.w2.detach().contiguous(),
                "b2": self.b2.detach().contiguous(), "alpha": self.alpha.detach().contiguous()}


def boundary_batch(p_tgt, qs, sink, window, k):
    """For steps qs: u = q - window, the boundary b = k-th best of p_tgt over [sink, u).
    p_tgt [S, H] -> (u [Q], b [H, Q], valid [Q])."""
    S, H = p_tgt.shape
    u = qs - window
    pos = torch.arange(S)
    elig = (pos[None, :] >= sink) & (pos[None, :] < u[:, None])  # [Q, S]
    scores = p_tgt.T[:, None, :].expand(H, len(qs), S).masked_fill(~elig[None], float("-inf"))
    vals, idx = torch.topk(scores, k, dim=-1)  # ties: topk is not position-stable; rare in fp32
    b = idx[..., -1]
    valid = (u - sink) >= k
    return u, b, valid


def train(args):
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    trains = [load_trace(p) for p in args.train]
    val = load_trace(args.val) if args.val else None
    L = len(trains[0]["layers"])
    H = trains[0]["k"][0].shape[1]
    D = trains[0]["k"][0].shape[2]
    print(f"traces loaded in {time.time() - t0:.1f} s: {L} layers, {H} KV heads, head_dim {D}")
    # Targets (once) and input statistics.
    sets = []
    for tr in trains + ([val] if val else []):
        t1 = time.time()
        tgt = []
        for l in range(L):
            r, _ = future_targets(tr["q"][l], tr["k"][l], args.window, args.eps)
            tgt.append(r)
        x = [torch.cat([tr["k"][l], tr["v"][l]], -1) for l in range(L)]  # [S, H, 2D]
        sets.append({"path": tr["path"], "x": x, "tgt": tgt, "S": x[0].shape[0]})
        print(f"targets for {tr['path']} in {time.time() - t1:.1f} s")
    train_sets = sets[: len(trains)]
    val_set = sets[-1] if val else None
    allx = [torch.cat([s["x"][l] for s in train_sets], 0) for l in range(L)]
    mu = torch.stack([x.mean(0) for x in allx])  # [L, H, in]
    sd = torch.stack([x.std(0) for x in allx]).clamp_min(1e-3)
    model = Scorer(L, H, 2 * D, args.hidden, mu, sd)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / max(1, args.steps)))))
    gen = torch.Generator().manual_seed(args.seed)
    history = []
    for step in range(args.steps):
        s = train_sets[step % len(train_sets)]
        S = s["S"]
        total = 0.0
        opt.zero_grad()
        for l in range(L):
            k = args.ks[int(torch.randint(len(args.ks), (1,), generator=gen))]
            lo = args.sink + args.window + k + 1
            hi = S - args.min_future
            if hi <= lo:
                continue
            # Uniform plus late-biased steps (the paper's sampling).
            uni = torch.randint(lo, hi, (args.batch // 2,), generator=gen)
            late = hi - 1 - (torch.rand(args.batch - args.batch // 2, generator=gen) ** 2 * (hi - lo)).long()
            qs = torch.cat([uni, late])
            lg = model.log_gamma(l, args.gamma_min, args.gamma_max)  # [H]
            pos = torch.arange(S).float()
            p_tgt = s["tgt"][l] - pos[:, None] * lg.detach()[None, :]
            u, b, valid = boundary_batch(p_tgt, qs, args.sink, args.window, k)
            if valid.sum() == 0:
                continue
            r = model.scores(l, s["x"][l])
            p_hat = r - pos[:, None] * lg[None, :]  # [S, H]
            hh = torch.arange(H)[:, None]
            delta_t = p_tgt[u[None, :].expand(H, -1), hh] - p_tgt[b, hh]  # [H, Q]
            y = torch.where(delta_t > 0, 1.0, -1.0)
            diff = p_hat[u[None, :].expand(H, -1), hh] - p_hat[b, hh]
            w_margin = args.omega_min + (1 - args.omega_min) * torch.sigmoid(delta_t.abs() / args.tau_omega)
            rho = ((y > 0).float().mean(1, keepdim=True)).clamp(1e-3, 1 - 1e-3)
            w_bal = torch.where(y > 0, 1 / (2 * rho), 1 / (2 * (1 - rho))).clamp(0.2, 5.0)
            w_bal = w_bal / w_bal.mean()
            loss = (w_margin * w_bal * F.softplus(-y * diff / args.tau))[:, valid].mean()
            (loss / L).backward()
            total += loss.item() / L
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {total:.4f} ({time.time() - t0:.0f} s)")
            history.append({"step": step, "loss": total})
    report = {"train": [s["path"] for s in train_sets], "history": history, "args": vars(args)}
    if val_set is not None:
        report["val"] = evaluate(model, val_set, args)
    weights = model.export()
    meta = {"format": "kvferry-kvpop-mlp-v1", "gamma_min": repr(args.gamma_min),
            "gamma_max": repr(args.gamma_max), "window": str(args.window), "sink": str(args.sink),
            "hidden": str(args.hidden), "model": trains[0]["meta"].get("model", ""),
            "trained_on": ",".join(args.train), "steps": str(args.steps),
            "input": "[k; v] as stored (k post-RoPE), fp32"}
    save_file(weights, args.out, metadata=meta)
    print(f"wrote {args.out}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    return report


@torch.no_grad()
def evaluate(model, s, args):
    """Held-out trace: at sampled steps, the future attention mass the k retained tokens will
    receive (sum of m_t over the kept set) relative to the teacher's kept set, for the trained
    scorer, the zero scorer (recency) and the scorer without its decay; also the overlap with the
    teacher's set."""
    S = s["S"]
    L = len(s["x"])
    out = {}
    for k in args.ks:
        lo = args.sink + args.window + k + 1
        hi = S - args.min_future
        if hi <= lo:
            continue
        qs = torch.linspace(lo, hi - 1, 16).long()
        acc = {"trained": [0.0, 0.0], "recency": [0.0, 0.0]}
        for l in range(L):
            lg = model.log_gamma(l, args.gamma_min, args.gamma_max)
            pos = torch.arange(S).float()
            m = s["tgt"][l].exp()  # eps + m, max over group
            p_tgt = s["tgt"][l] - pos[:, None] * lg[None, :]
            r = model.scores(l, s["x"][l])
            cands = {"trained": r - pos[:, None] * lg[None, :], "recency": pos[:, None].expand(S, r.shape[1])}
            for q in qs.tolist():
                u = q - args.window + 1  # eligible [sink, u)
                sl = slice(args.sink, u)
                teach = torch.topk(p_tgt[sl], k, dim=0).indices  # [k, H]
                mass_t = torch.gather(m[sl], 0, teach).sum(0)
                for name, p in cands.items():
                    kept = torch.topk(p[sl].float(), k, dim=0).indices
                    mass = torch.gather(m[sl], 0, kept).sum(0)
                    overlap = torch.tensor([len(set(kept[:, h].tolist()) & set(teach[:, h].tolist())) / k
                                            for h in range(kept.shape[1])])
                    acc[name][0] += (mass / mass_t).mean().item()
                    acc[name][1] += overlap.mean().item()
        cnt = L * len(qs)
        out[f"k{k}"] = {name: {"future_mass_vs_teacher": v[0] / cnt, "overlap_with_teacher": v[1] / cnt}
                        for name, v in acc.items()}
        print(f"val k={k}: " + ", ".join(f"{n} mass {v[0] / cnt:.4f} overlap {v[1] / cnt:.4f}"
                                          for n, v in acc.items()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", nargs="+", required=True, help="kvferry-llama trace files")
    ap.add_argument("--val", help="held-out trace")
    ap.add_argument("--out", required=True, help="scorer safetensors to write")
    ap.add_argument("--report", help="JSON with the loss history and validation")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64, help="the runtime's window (kvferry-llama --window)")
    ap.add_argument("--ks", type=int, nargs="+", default=[188, 444],
                    help="long-range slots k = budget - sink - window (budgets 256, 512)")
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=128, help="sampled steps per layer per update")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--omega-min", type=float, default=0.25)
    ap.add_argument("--tau-omega", type=float, default=1.0)
    ap.add_argument("--gamma-min", type=float, default=0.999)
    ap.add_argument("--gamma-max", type=float, default=0.999999)
    ap.add_argument("--min-future", type=int, default=256, help="steps need this many future queries")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    train(ap.parse_args())


if __name__ == "__main__":
    main()
