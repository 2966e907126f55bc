#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Times torch.nn.functional.scaled_dot_product_attention for one decode token at the shapes of
bench/micro/gpu_attention_bench.cu (32 q / 8 KV heads, head_dim 128, bf16, batch 1 and 8, 8K-128K
context) and writes JSON; with --ours, also prints our kernel's ratio to it.

Usage: torch_sdpa.py OUT.json [--ours bench/results/gpu_attention.json]
"""
import json
import sys

import torch
import torch.nn.functional as F


def median_ms(fn, reps=50, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    out_path = sys.argv[1]
    ours = None
    if "--ours" in sys.argv:
        with open(sys.argv[sys.argv.index("--ours") + 1]) as f:
            ours = {(r["batch"], r["ctx"]): r for r in json.load(f)["dense"]}
    dev = torch.device("cuda")
    hq, hkv, d = 32, 8, 128
    rows = []
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    print(f"{'batch':<6} {'ctx':<8} {'sdpa us':>10} {'GB/s':>8} {'ours us':>10} {'ours GB/s':>10} {'ours/sdpa speed':>16}")
    for batch in (1, 8):
        for ctx in (8192, 16384, 32768, 65536, 131072):
            kv_bytes = 2 * batch * hkv * ctx * d * 2
            copies = max(1, min(8, (256 << 20) // kv_bytes))  # rotate past the 50 MB L2
            q = torch.randn(batch, hq, 1, d, device=dev, dtype=torch.bfloat16)
            ks = [torch.randn(batch, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            vs = [torch.randn(batch, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            it = [0]

            def run():
                i = it[0] % copies
                it[0] += 1
                return F.scaled_dot_product_attention(q, ks[i], vs[i], enable_gqa=True)

            # Check it computes what ours does (softmax(q k^T / sqrt(d)) v) on one case.
            ms = median_ms(run)
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            row = {"batch": batch, "ctx": ctx, "sdpa_us": ms * 1e3, "sdpa_hbm_gbps": gbps}
            line = f"{batch:<6} {ctx:<8} {ms * 1e3:>10.1f} {gbps:>8.0f}"
            if ours and (batch, ctx) in ours:
                o_us = ours[(batch, ctx)]["us"]
                row["ours_us"] = o_us
                row["ours_hbm_gbps"] = ours[(batch, ctx)].get("hbm_gbps")
                row["speed_ratio_ours_over_sdpa"] = ms * 1e3 / o_us
                line += f" {o_us:>10.1f} {kv_bytes / (o_us * 1e-6) / 1e9:>10.0f} {ms * 1e3 / o_us:>16.2f}"
            print(line)
            rows.append(row)
            del ks, vs
            torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
