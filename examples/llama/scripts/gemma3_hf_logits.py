#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Hugging Face transformers' logits for Gemma 3 270M (CPU, f32), loading the same GGUF file the
engine reads (gguf_file=, dequantised by transformers), for tests/gemma3_real_test.cpp.

Writes data/gemma3_hf_logits.bin (git-ignored, 1 MB per kept position):
  "G3H2", u32 n, u32 vocab, u32 text bytes, u32 kept, the prompt text (UTF-8), n int32 token ids
  (BOS first, from transformers' tokenizer of the GGUF), kept u32 positions, kept * vocab f32
  logits of those positions.
The default prompt is a short sentence (all positions kept); --long N takes about N tokens of
Python's os.py source text (not committed anywhere; any text does) so that the sliding-window
layers (512) see more than their window, keeping the first 4 and the last 12 positions.
Run after scripts/fetch-data.sh --gemma3:
  /work/pyenv/bin/python examples/llama/scripts/gemma3_hf_logits.py [--data DIR] [--prompt TEXT | --long N]
"""
import argparse
import os
import struct
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--data", default=os.environ.get("KVFERRY_DATA_DIR", "data"))
ap.add_argument("--gguf", default="gemma-3-270m-q4_k_m.gguf")
ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. In the beginning God created")
ap.add_argument("--long", type=int, default=0)
args = ap.parse_args()
if args.long:
    src = open(os.__file__, encoding="utf-8").read()
    args.prompt = src[: args.long * 3]

t0 = time.time()
tok = AutoTokenizer.from_pretrained(args.data, gguf_file=args.gguf)
model = AutoModelForCausalLM.from_pretrained(args.data, gguf_file=args.gguf, dtype=torch.float32)
model.eval()
ids = tok(args.prompt, return_tensors="pt").input_ids
if ids[0, 0].item() != 2:  # BOS, as the engine's tokenizer adds it (tokenizer.ggml.add_bos_token)
    ids = torch.cat([torch.tensor([[2]]), ids], dim=1)
with torch.no_grad():
    logits = model(ids).logits[0].float().numpy()
n, vocab = logits.shape
kept = list(range(n)) if n <= 16 else list(range(4)) + list(range(n - 12, n))
text = args.prompt.encode()
out = os.path.join(args.data, "gemma3_hf_logits.bin")
with open(out, "wb") as f:
    f.write(b"G3H2" + struct.pack("<IIII", n, vocab, len(text), len(kept)) + text)
    f.write(ids[0].numpy().astype(np.int32).tobytes())
    f.write(np.array(kept, dtype=np.uint32).tobytes())
    f.write(logits[kept].astype(np.float32).tobytes())
print(f"{out}: {n} tokens {ids[0].tolist()}, vocab {vocab}, argmax of last {int(logits[-1].argmax())} "
      f"({tok.decode([int(logits[-1].argmax())])!r}), config: query_pre_attn_scalar "
      f"{model.config.query_pre_attn_scalar}, layer_types {model.config.layer_types[:6]}..., "
      f"{time.time() - t0:.1f} s")
