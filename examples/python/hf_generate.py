#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""SmolLM2 (Hugging Face transformers, loaded from the project's GGUF) generating from a long King
James Bible prompt twice: with its own attention and KV cache (dense), and with kvferry holding the
KV cache and choosing what each step attends. Prints tokens/s, KV bytes in device memory and both
outputs side by side.

    pip install .[hf]            # or: pip install . torch transformers accelerate gguf
    bash scripts/fetch-data.sh   # data/SmolLM2-135M-Instruct.Q4_1.gguf, data/kjv.txt
    python examples/python/hf_generate.py [--prompt-tokens 2000] [--new-tokens 48]
        [--policy lfps] [--budget 256] [--device cuda|cpu]
"""
import argparse
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kvferry
import kvferry.hf

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def cache_bytes(cache):
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def run(model, ids, new_tokens, impl, cache):
    model.config._attn_implementation = impl
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, past_key_values=cache)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out[0, ids.shape[1]:], time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=os.path.join(ROOT, "data", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--text", default=os.path.join(ROOT, "data", "kjv.txt"))
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--policy", default="lfps")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    for f in (a.gguf, a.text):
        if not os.path.exists(f):
            sys.exit(f"hf_generate: {f} not found (bash scripts/fetch-data.sh)")
    if a.device == "cuda" and not kvferry.cuda_available():
        sys.exit("hf_generate: kvferry was built without CUDA or sees no GPU; use --device cpu")
    d, name = os.path.split(a.gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype).to(a.device).eval()
    text = open(a.text, encoding="utf-8").read()
    ids = tok(text[: a.prompt_tokens * 8], return_tensors="pt").input_ids[:, : a.prompt_tokens]
    ids = ids.to(a.device)
    backend = "cuda" if a.device == "cuda" else "host"
    print(f"model {name}, prompt {ids.shape[1]} tokens of {os.path.basename(a.text)}, "
          f"{a.new_tokens} new tokens, greedy, {a.device}, transformers {__import__('transformers').__version__}")

    dense_cache = DynamicCache(config=model.config)
    dense_out, dense_s = run(model, ids, a.new_tokens, "eager" if a.device == "cpu" else "sdpa",
                             dense_cache)
    kv_cache = kvferry.hf.KvferryCache(model.config, policy=a.policy, budget=a.budget,
                                       window_tokens=a.window, backend=backend,
                                       max_tokens=ids.shape[1] + a.new_tokens + 16,
                                       max_batch=1)
    kvf_out, kvf_s = run(model, ids, a.new_tokens, "kvferry", kv_cache)
    st = kv_cache.runtime.stats()

    dense_bytes = cache_bytes(dense_cache)
    where = "GPU" if a.device == "cuda" else "host-emulated device"
    print()
    print(f"{'':28s}{'dense (HF cache)':>22s}{'kvferry ' + a.policy + '@' + str(a.budget):>24s}")
    print(f"{'tokens/s (prefill+decode)':28s}{a.new_tokens / dense_s:22.1f}{a.new_tokens / kvf_s:24.1f}")
    print(f"{'KV bytes in ' + where:28s}{dense_bytes:22,d}{int(st['device_bytes_reserved']):24,d}")
    print(f"{'KV bytes in host memory':28s}{0:22,d}{int(st['host_bytes_reserved']):24,d}")
    print(f"{'rows per layer step':28s}{'all':>22s}"
          f"{st['rows_selected'] / max(1, st['decode_tokens']):24.1f}")
    same = int((dense_out == kvf_out).sum())
    print(f"{'same tokens as dense':28s}{'':22s}{same:>20d} / {len(dense_out)}")
    print()
    print("dense  :", repr(tok.decode(dense_out)))
    print("kvferry:", repr(tok.decode(kvf_out)))


if __name__ == "__main__":
    main()
