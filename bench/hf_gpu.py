#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Hugging Face transformers decoding on one GPU: the model with transformers' own SDPA and its
DynamicCache, against the same model with attn_implementation="kvferry" and a kvferry.hf.KvferryCache
(the dense policy with every token resident, and sparse policies at a budget), in one process.

    python3 bench/hf_gpu.py --model smollm2 --contexts 8192 --batches 1,8 --json out.jsonl
    python3 bench/hf_gpu.py --model llama8b --layers 8 --contexts 32768,131072 --batches 1 --json out.jsonl

Models: "smollm2" is data/SmolLM2-135M-Instruct.Q4_1.gguf loaded by transformers (bf16), its prompt
windows of data/kjv.txt (batch b: b different windows); "llama8b" is a Llama with the attention and
MLP shape of Llama-3.1-8B (32 query heads, 8 KV heads of 128, hidden 4096, MLP 14336), --layers
layers, a 32000-token vocabulary and random bf16 weights, its prompt random tokens.

How it measures, the same for every lane: a short warm-up generate (not timed) on the lane's own
cache object, then one greedy generate of exactly --new-tokens tokens; prefill is the time to the
first new token's logits, decode the remaining --new-tokens - 1 forwards (tokens/s counts every
sequence of the batch). Memory: "kv_gpu_bytes" is the K/V the lane keeps in GPU memory (the
DynamicCache's tensors; kvferry's resident tier, bank and rings), "gpu_peak_bytes" torch's peak
allocation during the timed generate plus every byte kvferry reserved on the device. Greedy tokens
are compared with the SDPA lane's ("same_tokens"). kvferry's counters (rows selected, host syncs,
bank hits) cover the whole timed generate, its prefill included, over the decode's layer steps. One
JSON line per (model, context, batch, lane).
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("streaming", "sparcas", "quest", "hip", "lfps", "oracle")
# sdpa: transformers' own; dense: kvferry with every token resident; a policy name: kvferry at
# --budget, every non-resident pick read from host memory; NAME_bank: with a token bank of twice the
# budget's slots (the offloaded rows a step picks are served from GPU memory when they were picked
# lately).
# sdpa_nocudnn: transformers' SDPA with torch's cuDNN attention backend excluded (flash, memory-
# efficient or math kernels only): cuDNN builds an execution graph for each new key length, which a
# decode step has every step.
LANES = ("sdpa", "sdpa_nocudnn", "dense", *POLICIES, *(p + "_bank" for p in POLICIES if p != "streaming"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "llama8b"), default="smollm2")
    ap.add_argument("--gguf", default=os.path.join(ROOT, "data", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--text", default=os.path.join(ROOT, "data", "kjv.txt"))
    ap.add_argument("--layers", type=int, default=8, help="llama8b: layers (default: %(default)s)")
    ap.add_argument("--contexts", default="8192", help="prompt tokens, comma-separated")
    ap.add_argument("--batches", default="1", help="batch sizes, comma-separated")
    ap.add_argument("--lanes", default="sdpa,dense,streaming,sparcas",
                    help=f"comma-separated, of {', '.join(LANES)} (sdpa first: it is the baseline)")
    ap.add_argument("--budget", default="256",
                    help="sparse lanes' budget per sequence and KV head: tokens, or a percentage of "
                         "the context (\"2%%\")")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--json", required=True, help="JSON-lines output (appended)")
    a = ap.parse_args(argv)
    try:
        a.contexts = [int(x) for x in a.contexts.split(",")]
        a.batches = [int(x) for x in a.batches.split(",")]
    except ValueError:
        ap.error("--contexts and --batches take comma-separated integers")
    a.lanes = a.lanes.split(",")
    bad = [x for x in a.lanes if x not in LANES]
    if bad:
        ap.error(f"--lanes: unknown {', '.join(bad)} (known: {', '.join(LANES)})")
    if min(a.contexts) < 64 or min(a.batches) < 1 or a.new_tokens < 2 or a.layers < 1:
        ap.error("--contexts >= 64, --batches >= 1, --new-tokens >= 2, --layers >= 1")
    d = os.path.dirname(os.path.abspath(a.json))
    if not os.access(d, os.W_OK):
        ap.error(f"--json: {d} is not writable")
    return a


def budget_for(spec, ctx):
    if spec.endswith("%"):
        return max(1, int(round(ctx * float(spec[:-1]) / 100)))
    return int(spec)


def main(argv=None):
    a = parse_args(argv)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig

    import kvferry
    import kvferry.hf

    if not torch.cuda.is_available() or not kvferry.cuda_available():
        sys.exit("hf_gpu: needs a CUDA device seen by torch and a kvferry built with CUDA")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if a.model == "smollm2":
        d, name = os.path.split(a.gguf)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.bfloat16)
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
        need = max(a.contexts) * max(a.batches) + 64
        all_ids = tok(text[200_000: 200_000 + need * 6], return_tensors="pt").input_ids[0]
        if all_ids.numel() < need:
            sys.exit(f"hf_gpu: {a.text} gives {all_ids.numel()} tokens; need {need}")
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, num_hidden_layers=a.layers,
                          vocab_size=32000, max_position_embeddings=max(a.contexts) + a.new_tokens + 64,
                          rope_theta=500000.0, tie_word_embeddings=False)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        name = f"llama8b-shape-{a.layers}l-random"
        all_ids = torch.randint(0, cfg.vocab_size, (max(a.contexts) * max(a.batches) + 64,))
    query = ("the model's own (real decoding of KJV)" if a.model == "smollm2" else
             "a random-weight model's own (not a real query: speed only)")
    model = model.to(dev).eval()
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else (gc.eos_token_id or 0)
    pad = pad[0] if isinstance(pad, list) else pad

    def generate(ids, n_new, cache, backends=None):
        if backends is not None:
            with torch.nn.attention.sdpa_kernel(backends):
                return generate(ids, n_new, cache)
        first = {}

        class First(transformers.LogitsProcessor):
            def __call__(self, input_ids, scores):
                if "t" not in first:
                    torch.cuda.synchronize()
                    first["t"] = time.perf_counter()
                return scores

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, past_key_values=cache,
                                 logits_processor=transformers.LogitsProcessorList([First()]),
                                 pad_token_id=pad)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        return out[:, ids.shape[1]:].tolist(), first["t"] - t0, t1 - first["t"]

    out = open(a.json, "a")
    for ctx in a.contexts:
        for b in a.batches:
            ids = torch.stack([all_ids[i * ctx: (i + 1) * ctx] for i in range(b)]).to(dev)
            warm = ids[:, :64]
            base_tokens, base_tps, nocudnn_tps = None, None, None
            for lane in a.lanes:
                row = dict(bench="hf_gpu", model=name, context=ctx, batch=b, lane=lane, query=query,
                           new_tokens=a.new_tokens, transformers=transformers.__version__,
                           torch=torch.__version__)
                backends = None
                try:
                    if lane.startswith("sdpa"):
                        from torch.nn.attention import SDPBackend
                        if lane == "sdpa_nocudnn":
                            backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
                        model.set_attn_implementation("sdpa")
                        generate(warm, 4, DynamicCache(config=model.config), backends)
                        cache = DynamicCache(config=model.config)
                        row.update(attention="transformers sdpa" + (" (no cuDNN)" if backends else ""),
                                   cache="DynamicCache")
                    else:
                        max_tokens = ctx + a.new_tokens + 16
                        if lane == "dense":  # every token resident: the window covers the context
                            kw = dict(policy="dense", budget=max_tokens, sink_tokens=0,
                                      window_tokens=max_tokens)
                        else:
                            budget = budget_for(a.budget, ctx)
                            kw = dict(policy=lane.removesuffix("_bank"), budget=budget,
                                      sink_tokens=a.sinks, window_tokens=a.window,
                                      bank_slots=2 * budget if lane.endswith("_bank") else 0)
                        model.set_attn_implementation("kvferry")
                        cache = kvferry.hf.KvferryCache(model, backend="cuda", max_tokens=max_tokens,
                                                        max_batch=b, max_prefill_chunk=min(a.prefill_chunk, ctx),
                                                        **kw)
                        generate(warm, 4, cache)  # warm-up on the same runtime, not measured
                        cache.reset()
                        cache.runtime.reset_stats()
                        row.update(attention="kvferry", cache="KvferryCache", **kw)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    tokens, prefill_s, decode_s = generate(ids, a.new_tokens, cache, backends)
                    peak = torch.cuda.max_memory_allocated()
                    row.update(prefill_s=prefill_s, decode_s=decode_s,
                               prefill_tokens_per_second=b * ctx / prefill_s,
                               decode_tokens_per_second=b * (a.new_tokens - 1) / decode_s)
                    if lane.startswith("sdpa"):
                        row.update(kv_gpu_bytes=kvferry.hf.kv_tensor_bytes(cache), gpu_peak_bytes=peak)
                        if lane == "sdpa_nocudnn":
                            nocudnn_tps = row["decode_tokens_per_second"]
                        if base_tokens is None:
                            base_tokens, base_tps = tokens, row["decode_tokens_per_second"]
                    else:
                        st = cache.runtime.stats()
                        row.update(kv_gpu_bytes=cache.kv_bytes_on_gpu(),
                                   kvferry_device_bytes=int(st["device_bytes_reserved"]),
                                   gpu_peak_bytes=peak + int(st["device_bytes_reserved"]),
                                   host_bytes=int(st["host_bytes_reserved"]),
                                   rows_selected_per_layer_step=st["rows_selected"] / max(1, st["decode_tokens"]),
                                   host_syncs_per_layer_step=st.get("host_syncs", 0) / max(1, st["decode_tokens"]),
                                   bank_hit=st.get("rows_bank_hit", 0), rows_fetched=st.get("rows_fetched", 0))
                        hit, miss = row["bank_hit"], row["rows_fetched"]
                        row["bank_hit_rate"] = hit / (hit + miss) if kw.get("bank_slots") and hit + miss else None
                    if base_tokens is not None:
                        row["same_tokens"] = sum(int(x == y) for p, q in zip(tokens, base_tokens)
                                                 for x, y in zip(p, q))
                        row["tokens_compared"] = sum(len(p) for p in tokens)
                        row["decode_vs_sdpa"] = row["decode_tokens_per_second"] / base_tps
                        if nocudnn_tps:
                            row["decode_vs_sdpa_nocudnn"] = row["decode_tokens_per_second"] / nocudnn_tps
                    del cache
                except Exception as e:  # a lane that cannot run (memory, capacity) says why
                    row["skipped"] = f"{type(e).__name__}: {e}"[:400]
                torch.cuda.empty_cache()
                row["first_tokens"] = tokens[0][:8] if "skipped" not in row else None
                print(f"{name} ctx {ctx} b{b} {lane:9s}", row.get("skipped") or
                      f"decode {row['decode_tokens_per_second']:8.1f} tok/s ({row.get('decode_vs_sdpa', 0):.2f}x sdpa) "
                      f"prefill {row['prefill_tokens_per_second']:8.0f} tok/s kv_gpu {row['kv_gpu_bytes'] / 2**20:8.1f} MiB "
                      f"peak {row['gpu_peak_bytes'] / 2**30:6.2f} GiB same {row.get('same_tokens')}/"
                      f"{row.get('tokens_compared')} first {row['first_tokens']}", flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
