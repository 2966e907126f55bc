#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""A Hugging Face transformers model (SmolLM2 from the project's GGUF by default) generating from a
long King James Bible prompt twice: with its own attention and KV cache (dense, a DynamicCache), and
with kvferry holding the KV cache and choosing what each step attends. Prints the prefill time and
decode tokens/s of both, where each keeps its KV and how much, and both outputs side by side.

    pip install ".[hf]"          # from the checkout: kvferry + torch, transformers, accelerate, gguf
    bash scripts/fetch-data.sh   # data/SmolLM2-135M-Instruct.Q4_1.gguf, data/kjv.txt
    python examples/python/hf_generate.py [--prompt-tokens 2000] [--new-tokens 48]
        [--policy lfps] [--budget 256] [--sinks 4] [--window 128] [--device cuda|cpu]
        [--prefill-chunk 512] [--dense-attn sdpa|eager]
        [--model DIR]            # any Hugging Face model directory instead of --gguf

How it measures. Both paths run the same way: one short warm-up generate first (not timed), then
the timed generate, greedy, with exactly --new-tokens new tokens; "prefill" is the time to the first
new token's logits, "decode" the remaining tokens (one forward each) to the end. The cache is made
before the clock starts. Memory: with --device cuda, "KV in GPU memory" is the bytes of the dense
cache's K/V tensors, and kvferry's resident tier plus token bank and sliding-window rings
(Runtime.device_memory);
"GPU memory held by the cache" is the drop in free device memory (cudaMemGetInfo, after
torch.cuda.empty_cache) from before the cache was made to after the timed generate, which for
kvferry also counts its staging buffers and workspaces. With --device cpu, kvferry's host backend
keeps the same buffers in host memory ("device tier (host-emulated)"), and the dense cache is the
K/V a GPU would have to hold. kvferry keeps every token in its host store (host_bytes_reserved) and
only the sinks and the recent window in the device tier. "tokens attended" is per layer step and KV
head: kvferry's budget counts the sinks and the window, so it is --budget once the context exceeds it.
kvferry's staging buffers are sized by --prefill-chunk (the prompt goes in chunks of that many
tokens); the table's last line lists every buffer kvferry reserved.
"""
import argparse
import os
import sys
import time

import kvferry

try:
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DynamicCache, LogitsProcessor,
                              LogitsProcessorList)

    import kvferry.hf
except ImportError as e:  # kvferry installed without its "hf" extra
    raise kvferry.missing_extra("hf", "examples/python/hf_generate.py", e) from e

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=os.path.join(ROOT, "data", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                    help="GGUF file of the model and its tokenizer (default: %(default)s)")
    ap.add_argument("--model", default=None,
                    help="a Hugging Face model directory (or hub name) to load instead of --gguf")
    ap.add_argument("--text", default=os.path.join(ROOT, "data", "kjv.txt"),
                    help="the prompt's text; its first --prompt-tokens tokens (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--policy", default="lfps", help=f"one of {', '.join(kvferry.policy_names())}")
    ap.add_argument("--budget", type=int, default=256,
                    help="tokens attended per layer step and KV head, sinks and window included")
    ap.add_argument("--sinks", type=int, default=4, help="first tokens kept in the device tier")
    ap.add_argument("--window", type=int, default=128, help="recent tokens kept in the device tier")
    ap.add_argument("--prefill-chunk", type=int, default=512,
                    help="prompt tokens per kvferry prefill call; kvferry's input staging and "
                         "attention partials are sized by it (default: %(default)s)")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dense-attn", default="sdpa", choices=("sdpa", "eager"),
                    help="transformers' attention for the dense path (default: %(default)s)")
    ap.add_argument("--quiet", action="store_true", help="return the results without printing")
    a = ap.parse_args(argv)
    for flag, value, low in (("--prompt-tokens", a.prompt_tokens, 2), ("--new-tokens", a.new_tokens, 2),
                             ("--budget", a.budget, 0), ("--sinks", a.sinks, 0), ("--window", a.window, 1),
                             ("--prefill-chunk", a.prefill_chunk, 1)):
        if value < low:
            ap.error(f"{flag} must be >= {low} (got {value})")
    return a


def cache_dtype(cache):
    for layer in getattr(cache, "layers", []):
        t = getattr(layer, "keys", None)
        if isinstance(t, torch.Tensor):
            return str(t.dtype).replace("torch.", "")
    return "?"


def gpu_bytes_in_use():
    """Device memory in use (cudaMemGetInfo), after torch releases its unused cached blocks."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


class _FirstLogits(LogitsProcessor):
    """Records when the first new token's logits exist (the end of the prefill)."""

    def __init__(self, cuda):
        self.cuda, self.t = cuda, None

    def __call__(self, input_ids, scores):
        if self.t is None:
            if self.cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()
        return scores


def generate(model, ids, new_tokens, cache):
    """Greedy generate of exactly new_tokens tokens; returns (new tokens, prefill s, decode s)."""
    first = _FirstLogits(ids.is_cuda)
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else (gc.eos_token_id or 0)
    if isinstance(pad, list):
        pad = pad[0]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, past_key_values=cache,
                             logits_processor=LogitsProcessorList([first]), pad_token_id=pad)
    if ids.is_cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    return out[0, ids.shape[1]:].tolist(), first.t - t0, t1 - first.t


def load(a):
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    if a.model:
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
        name = os.path.basename(os.path.normpath(a.model))
    else:
        d, name = os.path.split(a.gguf)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype)
    return tok, model.to(a.device).eval(), name


def prompt_ids(tok, text, n):
    ids = tok(text[: n * 8], return_tensors="pt").input_ids
    if ids.shape[1] < n:  # fewer than 8 characters a token: take the whole text
        ids = tok(text, return_tensors="pt").input_ids
    return ids[:, :n]


def run_dense(model, ids, a, attn):
    model.set_attn_implementation(attn)
    warm = ids[:, : min(ids.shape[1], 32)]
    generate(model, warm, 2, DynamicCache(config=model.config))  # warm-up, not measured
    before = gpu_bytes_in_use() if ids.is_cuda else 0
    cache = DynamicCache(config=model.config)
    tokens, prefill_s, decode_s = generate(model, ids, a.new_tokens, cache)
    r = dict(attn=attn, tokens=tokens, prefill_s=prefill_s, decode_s=decode_s,
             kv_dtype=cache_dtype(cache), kv_device_bytes=kvferry.hf.kv_tensor_bytes(cache), host_store_bytes=0,
             other_device_bytes=0)
    if ids.is_cuda:
        r["gpu_bytes_held"] = gpu_bytes_in_use() - before
    # Every position of the context: at decode step i (1..new-1) the context is prompt + i.
    n = ids.shape[1]
    r["attended_per_step"] = sum(n + i for i in range(1, a.new_tokens)) / (a.new_tokens - 1)
    return r


def run_kvferry(model, ids, a):
    before = gpu_bytes_in_use() if ids.is_cuda else 0
    n = ids.shape[1]
    cache = kvferry.hf.KvferryCache(
        model.config, policy=a.policy, budget=a.budget, sink_tokens=a.sinks,
        window_tokens=a.window, backend="cuda" if ids.is_cuda else "host",
        max_tokens=n + a.new_tokens + 16, max_batch=1, max_prefill_chunk=min(a.prefill_chunk, n))
    model.set_attn_implementation("kvferry")
    generate(model, ids[:, : min(n, 32)], 2, cache)  # warm-up on the same runtime, not measured
    cache.reset()
    cache.runtime.reset_stats()
    tokens, prefill_s, decode_s = generate(model, ids, a.new_tokens, cache)
    rt = cache.runtime
    st = rt.stats()
    mem = rt.device_memory()
    parts = mem["parts"]
    kv_device = (parts.get("resident tier", 0) + parts.get("bank rows", 0) +
                 parts.get("sliding-window rings", 0))
    r = dict(tokens=tokens, prefill_s=prefill_s, decode_s=decode_s, kv_dtype=rt.config.kv_dtype,
             kv_device_bytes=kv_device,
             other_device_bytes=int(st["device_bytes_reserved"]) - kv_device,
             device_bytes_reserved=int(st["device_bytes_reserved"]), device_parts=dict(parts),
             host_store_bytes=int(st["host_bytes_reserved"]), stats=st)
    if ids.is_cuda:
        r["gpu_bytes_held"] = gpu_bytes_in_use() - before
    heads = rt.config.num_kv_heads
    r["attended_per_step"] = st["rows_selected"] / max(1, st["decode_tokens"]) / heads
    r["decode_steps"] = int(st["decode_tokens"]) // rt.config.num_layers
    return r


def compare(model, ids, a):
    """Runs both paths on prompt ids [1, T]; returns the results as a dict (see main)."""
    dense = run_dense(model, ids, a, a.dense_attn)
    kvf = run_kvferry(model, ids, a)
    for r in (dense, kvf):
        r["decode_tok_s"] = (a.new_tokens - 1) / r["decode_s"]
        r["prefill_tok_s"] = ids.shape[1] / r["prefill_s"]
    same = sum(int(x == y) for x, y in zip(dense["tokens"], kvf["tokens"]))
    return dict(device=a.device, backend="cuda" if a.device == "cuda" else "host",
                prompt_tokens=int(ids.shape[1]), new_tokens=a.new_tokens, policy=a.policy,
                budget=a.budget, sinks=a.sinks, window=a.window, dense=dense, kvferry=kvf,
                same_tokens=same)


def report(res, tok, name, text_name):
    import transformers

    d, k = res["dense"], res["kvferry"]
    cuda = res["device"] == "cuda"
    print(f"model {name}, prompt {res['prompt_tokens']} tokens of {text_name}, "
          f"{res['new_tokens']} new tokens, greedy, {res['device']}, transformers "
          f"{transformers.__version__}; each path warmed up first, then timed the same way")
    selected = max(0, res["budget"] - res["sinks"] - res["window"])
    where = "GPU memory" if cuda else "device tier (host-emulated)"
    rows = [
        ("prefill s (prompt tokens/s)", f"{d['prefill_s']:.3f} ({d['prefill_tok_s']:,.0f})",
         f"{k['prefill_s']:.3f} ({k['prefill_tok_s']:,.0f})"),
        (f"decode tokens/s ({res['new_tokens'] - 1} tokens)", f"{d['decode_tok_s']:,.1f}",
         f"{k['decode_tok_s']:,.1f}"),
        (f"KV in {where}, bytes", f"{d['kv_device_bytes']:,d}", f"{k['kv_device_bytes']:,d}"),
        ("  which tokens", f"all, {d['kv_dtype']}",
         f"{res['sinks']} sinks+{res['window']} window, {k['kv_dtype']}"),
        ("kvferry staging+workspaces, bytes", "-", f"{k['other_device_bytes']:,d}"),
    ]
    if cuda:
        rows.append(("GPU memory held by the cache", f"{d['gpu_bytes_held']:,d}",
                     f"{k['gpu_bytes_held']:,d}"))
    rows += [
        ("KV in host memory (reserved), bytes", "-" if cuda else "(the row above)",
         f"{k['host_store_bytes']:,d} (all)"),
        ("tokens attended per layer step", f"{d['attended_per_step']:.1f} (all)",
         f"{k['attended_per_step']:.1f}"),
        ("  and KV head (mean over steps)", "",
         f"budget {res['budget']} = {res['sinks']}+{res['window']}+{selected}"),
        ("same tokens as dense", "", f"{res['same_tokens']} / {len(d['tokens'])}"),
    ]
    w = max(len(r[0]) for r in rows) + 2
    print()
    print(f"{'':{w}s}{'dense (' + d['attn'] + ', DynamicCache)':>26s}"
          f"{'kvferry ' + res['policy'] + '@' + str(res['budget']):>30s}")
    for label, dv, kv in rows:
        print(f"{label:{w}s}{dv:>26s}{kv:>30s}")
    print()
    print("dense  :", repr(tok.decode(d["tokens"])))
    print("kvferry:", repr(tok.decode(k["tokens"])))
    parts = ", ".join(f"{p} {b:,d}" for p, b in k["device_parts"].items())
    print()
    print(f"kvferry's device buffers ({'GPU' if cuda else 'host-emulated'}; reserved when the cache "
          f"is made, sized by its capacity): {parts}")


def main(argv=None):
    """Parses argv (sys.argv by default), runs both paths, prints the table (unless --quiet) and
    returns the results: device, backend, prompt_tokens, new_tokens, policy, budget, sinks, window,
    same_tokens, and per path ("dense", "kvferry") tokens, prefill_s, decode_s, decode_tok_s,
    prefill_tok_s, kv_device_bytes, kv_dtype, other_device_bytes, host_store_bytes,
    attended_per_step (and gpu_bytes_held on CUDA); kvferry adds device_parts, device_bytes_reserved,
    decode_steps and stats."""
    a = parse_args(argv)
    needed = [a.text] + ([] if a.model else [a.gguf])
    for f in needed:
        if not os.path.exists(f):
            sys.exit(f"hf_generate: {f} not found (bash scripts/fetch-data.sh)")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("hf_generate: torch sees no CUDA device; use --device cpu")
    if a.device == "cuda" and not kvferry.cuda_available():
        sys.exit("hf_generate: kvferry was built without CUDA or sees no GPU; use --device cpu")
    tok, model, name = load(a)
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    ids = prompt_ids(tok, text, a.prompt_tokens).to(a.device)
    if ids.shape[1] < 2:
        sys.exit(f"hf_generate: {a.text} gives {ids.shape[1]} tokens; need at least 2")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and ids.shape[1] + a.new_tokens > limit:
        print(f"hf_generate: warning: {ids.shape[1]} + {a.new_tokens} tokens exceed the model's "
              f"max_position_embeddings {limit}", file=sys.stderr)
    res = compare(model, ids, a)
    if not a.quiet:
        report(res, tok, name, os.path.basename(a.text))
    return res


if __name__ == "__main__":
    main()
