#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Writes tests/data/gemma3_tiny.gguf: a random Gemma-3-shaped model in llama.cpp's GGUF layout
(architecture "gemma3", norm weights stored as Gemma's 1 + w as llama.cpp's converter does), with
the logits of an independent numpy forward pass (float64) for a short prompt stored beside the
weights as metadata: kvferry.test.tokens (int32 array) and kvferry.test.logits (f32 array,
[tokens, vocab] row-major).

Shape: 6 layers (layer 5 global, the others sliding-window of 8 tokens), hidden 32, 4 query heads
and 1 KV head of 64 dims (q_dim 256 != hidden, as in Gemma 3 270M), GeGLU of 256, vocab 300. The
tensors are stored in several ggml types (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K); the
reference uses the gguf package's dequantisation of exactly the stored bytes.
Run: /work/pyenv/bin/python examples/llama/scripts/gen_gemma3_tiny.py [out]
"""
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 6, 32, 4, 1, 64, 256, 300
WINDOW, PATTERN, CTX = 8, 6, 128
THETA_GLOBAL, THETA_LOCAL, EPS = 1e6, 1e4, 1e-6
PROMPT_LEN = 24

rng = np.random.default_rng(270)


def random_kquant(qtype, rows, cols, target_std):
    """Random K-quant blocks (gguf-py cannot quantise K types) with scales that give about
    target_std: random quants, scales and mins; f16 d/dmin chosen per super-block."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    nblocks = rows * cols // elems
    raw = rng.integers(0, 256, size=(nblocks, nbytes), dtype=np.uint8)
    if qtype in (T.Q4_K, T.Q5_K):
        qmax = 15 if qtype == T.Q4_K else 31
        d = np.full(nblocks, target_std * 1.7 / (31.5 * qmax / 2), dtype=np.float16)
        dmin = np.full(nblocks, float(d[0]) * qmax / 2 * 31.5 / 31.5, dtype=np.float16)
        raw[:, 0:2] = d.view(np.uint8).reshape(nblocks, 2)
        raw[:, 2:4] = dmin.view(np.uint8).reshape(nblocks, 2)
    elif qtype == T.Q6_K:
        d = np.full(nblocks, target_std / (64 * 18), dtype=np.float16)
        raw[:, 208:210] = d.view(np.uint8).reshape(nblocks, 2)
    else:
        raise ValueError(qtype)
    data = raw.reshape(rows, -1)
    return data, dequantize(data, qtype).astype(np.float64).reshape(rows, cols)


class Writer:
    def __init__(self, path):
        self.w = gguf.GGUFWriter(path, "gemma3")
        self.weights = {}

    def add(self, name, value, qtype=T.F32):
        value = np.asarray(value, dtype=np.float32)
        if qtype == T.F32:
            self.w.add_tensor(name, value)
            self.weights[name] = value.astype(np.float64)
        elif qtype == T.F16:
            self.w.add_tensor(name, value.astype(np.float16))
            self.weights[name] = value.astype(np.float16).astype(np.float64)
        else:
            data = quantize(value, qtype)
            self.w.add_tensor(name, data, raw_dtype=qtype)
            self.weights[name] = dequantize(data, qtype).astype(np.float64).reshape(value.shape)

    def add_raw(self, name, data, qtype, deq):
        self.w.add_tensor(name, data, raw_dtype=qtype)
        self.weights[name] = deq


def rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def rope(x, pos, theta):  # x [T, H, D], rotate_half pairing (i, i + D/2)
    half = HEAD_DIM // 2
    inv = 1.0 / theta ** (np.arange(half) * 2.0 / HEAD_DIM)
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., :half], x[..., half:]
    return np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def forward(W, tokens):
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][tokens] * np.sqrt(DIM)
    for l in range(LAYERS):
        p = f"blk.{l}."
        is_global = (l + 1) % PATTERN == 0
        h = rms(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T).reshape(n, HEADS, HEAD_DIM)
        k = (h @ W[p + "attn_k.weight"].T).reshape(n, KV_HEADS, HEAD_DIM)
        v = (h @ W[p + "attn_v.weight"].T).reshape(n, KV_HEADS, HEAD_DIM)
        q = rms(q, W[p + "attn_q_norm.weight"])
        k = rms(k, W[p + "attn_k_norm.weight"])
        theta = THETA_GLOBAL if is_global else THETA_LOCAL
        q, k = rope(q, pos, theta), rope(k, pos, theta)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        mask = (j <= i) if is_global else ((j <= i) & (j > i - WINDOW))
        out = np.zeros((n, HEADS, HEAD_DIM))
        for hq in range(HEADS):
            kv = hq // (HEADS // KV_HEADS)
            s = q[:, hq, :] @ k[:, kv, :].T / np.sqrt(HEAD_DIM)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            out[:, hq, :] = s @ v[:, kv, :]
        o = out.reshape(n, HEADS * HEAD_DIM) @ W[p + "attn_output.weight"].T
        x = x + rms(o, W[p + "post_attention_norm.weight"])
        h = rms(x, W[p + "ffn_norm.weight"])
        g = gelu_tanh(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)
        d = g @ W[p + "ffn_down.weight"].T
        x = x + rms(d, W[p + "post_ffw_norm.weight"])
    x = rms(x, W["output_norm.weight"])
    return x @ W["token_embd.weight"].T


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/data/gemma3_tiny.gguf"
    wr = Writer(out)
    w = wr.w
    w.add_name("gemma3-tiny-synthetic")
    w.add_context_length(CTX)
    w.add_embedding_length(DIM)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(THETA_GLOBAL)
    w.add_layer_norm_rms_eps(EPS)
    w.add_sliding_window(WINDOW)
    w.add_vocab_size(VOCAB)
    # A placeholder SentencePiece vocabulary (the engine's tests feed token ids).
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)

    def norm(n):
        return 1.0 + 0.2 * rng.standard_normal(n)  # Gemma's 1 + w, as llama.cpp stores it

    wr.add("token_embd.weight", 0.5 * rng.standard_normal((VOCAB, DIM)), T.Q8_0)
    qdim, kvdim = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    s_in = 1.0 / np.sqrt(DIM)
    for l in range(LAYERS):
        p = f"blk.{l}."
        wr.add(p + "attn_norm.weight", norm(DIM))
        wr.add(p + "attn_q_norm.weight", norm(HEAD_DIM))
        wr.add(p + "attn_k_norm.weight", norm(HEAD_DIM))
        wr.add(p + "post_attention_norm.weight", norm(DIM))
        wr.add(p + "ffn_norm.weight", norm(DIM))
        wr.add(p + "post_ffw_norm.weight", norm(DIM))
        wr.add(p + "attn_q.weight", s_in * rng.standard_normal((qdim, DIM)), T.Q5_0)
        wr.add(p + "attn_k.weight", s_in * rng.standard_normal((kvdim, DIM)), T.Q5_1)
        wr.add(p + "attn_v.weight", s_in * rng.standard_normal((kvdim, DIM)), T.F16 if l % 2 else T.Q8_0)
        data, deq = random_kquant(T.Q5_K if l % 2 else T.Q4_K, DIM, qdim, 1.0 / np.sqrt(qdim))
        wr.add_raw(p + "attn_output.weight", data, T.Q5_K if l % 2 else T.Q4_K, deq)
        wr.add(p + "ffn_gate.weight", s_in * rng.standard_normal((FFN, DIM)), T.Q4_0)
        wr.add(p + "ffn_up.weight", s_in * rng.standard_normal((FFN, DIM)), T.Q4_1)
        data, deq = random_kquant(T.Q6_K, DIM, FFN, 1.0 / np.sqrt(FFN))
        wr.add_raw(p + "ffn_down.weight", data, T.Q6_K, deq)
    wr.add("output_norm.weight", norm(DIM))

    tokens = rng.integers(3, VOCAB, size=PROMPT_LEN).astype(np.int32)
    tokens[0] = 2  # BOS
    logits = forward(wr.weights, tokens)
    w.add_array("kvferry.test.tokens", [int(t) for t in tokens])
    w.add_array("kvferry.test.logits", [float(v) for v in logits.astype(np.float32).reshape(-1)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(out, "logits std", float(logits.std()), "max", float(np.abs(logits).max()))


if __name__ == "__main__":
    main()
