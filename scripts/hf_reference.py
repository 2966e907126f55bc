#!/usr/bin/env python3
"""Records reference logits of SmolLM2-135M-Instruct (GGUF, Q4_1) with Hugging Face transformers.

transformers loads the same GGUF file (gguf_file=...), dequantises every tensor to float32 with the
`gguf` package and un-permutes the Q/K rows, so this is an implementation independent of kvferry's
engine that starts from the very same weights. Run on the CPU in float32 with eager attention.

Writes a safetensors file (read by tests/llama_smollm2_test.cpp):
  tokens        I32 [T]         token ids of the prompt, from the HF tokenizer built from the GGUF
  top_ids       I32 [T, K]      the K largest logits' ids at every position, descending
  top_logits    F32 [T, K]
  full_logits   F32 [P, V]      every logit at positions full_positions
  full_positions I32 [P]
  text_ids      I32 [N]         HF token ids of a longer text (tokenizer check)
__metadata__: prompt, text, model file, sha256, transformers/torch versions.

Setup (PyPI only):  python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers gguf safetensors
Usage:  /tmp/hfvenv/bin/python scripts/hf_reference.py [--gguf data/SmolLM2-135M-Instruct.Q4_1.gguf]
            [--out tests/data/smollm2_reference.safetensors]
"""
import argparse
import hashlib
import os
import sys

import numpy as np
import torch
from safetensors.numpy import save_file
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = (
    "<|im_start|>user\nIn the beginning God created the heaven and the earth. And the earth was "
    "without form, and void. Remember the number 48213, it is important.<|im_end|>\n"
    "<|im_start|>assistant\nThe number to remember is"
)

TEXT = (
    "And God said, Let there be light: and there was light. And God saw the light, that it was "
    "good: and God divided the light from the darkness.\nThe pass key is 71942. Remember it. "
    "71942 is the pass key. Thou shalt not take the name of the LORD thy God in vain; for the "
    "LORD will not hold him guiltless that taketh his name in vain.  It's 3.14, isn't it?\n\n"
    "  Multiple   spaces\tand tabs... (parentheses) [brackets] {braces} naïve café résumé."
)


def main():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=os.path.join(repo, "data", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=os.path.join(repo, "tests", "data",
                                                  "smollm2_reference.safetensors"))
    ap.add_argument("--top-k", type=int, default=20)
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gguf_dir, gguf_name = os.path.split(os.path.abspath(args.gguf))
    with open(args.gguf, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32, attn_implementation="eager")
    model.eval()

    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    n, vocab = logits.shape
    top = np.argsort(-logits, axis=1, kind="stable")[:, : args.top_k]
    full_positions = np.array([0, n // 2, n - 1], dtype=np.int32)
    text_ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    tensors = {
        "tokens": np.array(ids, dtype=np.int32),
        "top_ids": top.astype(np.int32),
        "top_logits": np.take_along_axis(logits, top, axis=1).astype(np.float32),
        "full_logits": logits[full_positions].astype(np.float32),
        "full_positions": full_positions,
        "text_ids": np.array(text_ids, dtype=np.int32),
    }
    meta = {
        "prompt": PROMPT,
        "text": TEXT,
        "model_file": gguf_name,
        "model_sha256": sha,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "greedy_continuation": tok.decode(model.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0][n:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file(tensors, args.out, metadata=meta)
    print(f"{args.out}: {n} positions, vocab {vocab}, argmax {logits.argmax(1).tolist()}")
    print(f"greedy continuation: {meta['greedy_continuation']!r}")
    print(f"text ids ({len(text_ids)}): {text_ids[:40]} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
