#!/usr/bin/env python3
"""Writes the committed seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/).

Deterministic; run from anywhere: python3 tests/fuzz/make_seeds.py. Seeds are small valid (and a
few deliberately broken) inputs of each format, derived from tests/data where a real file helps.
Inputs that once crashed a target live next to them as regression-*; this script leaves those be.
"""
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data")
CORPUS = os.path.join(HERE, "corpus")


def write(target, name, data):
    folder = os.path.join(CORPUS, target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


# ---- GGUF --------------------------------------------------------------------------------------

def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


class Gguf:
    def __init__(self, version=3):
        self.version = version
        self.kv = []
        self.tensors = []

    def u32(self, k, v): self.kv.append(gstr(k) + struct.pack("<II", 4, v))
    def i32(self, k, v): self.kv.append(gstr(k) + struct.pack("<Ii", 5, v))
    def f32(self, k, v): self.kv.append(gstr(k) + struct.pack("<If", 6, v))
    def f64(self, k, v): self.kv.append(gstr(k) + struct.pack("<Id", 12, v))
    def u64(self, k, v): self.kv.append(gstr(k) + struct.pack("<IQ", 10, v))
    def boolean(self, k, v): self.kv.append(gstr(k) + struct.pack("<IB", 7, v))
    def s(self, k, v): self.kv.append(gstr(k) + struct.pack("<I", 8) + gstr(v))

    def strs(self, k, vs):
        self.kv.append(gstr(k) + struct.pack("<IIQ", 9, 8, len(vs)) + b"".join(gstr(v) for v in vs))

    def i32s(self, k, vs):
        self.kv.append(gstr(k) + struct.pack("<IIQ", 9, 5, len(vs)) + struct.pack("<%di" % len(vs), *vs))

    def nested(self, k):
        inner = struct.pack("<IQ", 4, 2) + struct.pack("<II", 1, 2)
        self.kv.append(gstr(k) + struct.pack("<IIQ", 9, 9, 2) + inner + inner)

    def tensor(self, name, dims, ggml_type, data):
        self.tensors.append((name, dims, ggml_type, data))

    def build(self, align=32):
        out = b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv))
        out += b"".join(self.kv)
        offset = 0
        for name, dims, t, data in self.tensors:
            out += gstr(name) + struct.pack("<I", len(dims)) + struct.pack("<%dQ" % len(dims), *dims)
            out += struct.pack("<IQ", t, offset)
            offset += (len(data) + align - 1) // align * align
        out += b"\0" * ((-len(out)) % align)
        for _, _, _, data in self.tensors:
            out += data + b"\0" * ((-len(data)) % align)
        return out


def half(x):
    return struct.pack("<e", x)


def block(t, n, rng):
    """n elements of ggml type t with small finite scales."""
    if t == 0:
        return struct.pack("<%df" % n, *[rng.choice([-0.5, 0.25, 0.0, 0.5]) for _ in range(n)])
    if t == 1:
        return b"".join(half(rng.choice([-0.5, 0.25, 0.0, 0.5])) for _ in range(n))
    if t == 30:
        return b"".join(struct.pack("<f", rng.choice([-0.5, 0.5]))[2:] for _ in range(n))
    out = b""
    for _ in range(n // 32):
        if t == 2:
            out += half(0.0625) + bytes(rng.randrange(256) for _ in range(16))
        elif t == 3:
            out += half(0.0625) + half(-0.5) + bytes(rng.randrange(256) for _ in range(16))
        elif t == 8:
            out += half(0.0625) + bytes(rng.randrange(256) for _ in range(32))
    return out


def gpt2_byte_symbols():
    syms, extra = [], 0
    for b in range(256):
        printable = (ord("!") <= b <= ord("~")) or (0xA1 <= b <= 0xAC) or b >= 0xAE
        syms.append(chr(b if printable else 256 + extra))
        if not printable:
            extra += 1
    return syms


def tokenizer_kv(g, with_bytes=False):
    tokens = ["<|endoftext|>", "a", "b", "ab", "\u0120", "\u0120a", "c", "d"]
    types = [3, 1, 1, 1, 1, 1, 1, 1]
    if with_bytes:
        tokens += [t for t in gpt2_byte_symbols() if t not in tokens]
        types += [1] * (len(tokens) - len(types))
        tokens += ["<|im_start|>", "<|im_end|>"]
        types += [3, 3]
    g.s("tokenizer.ggml.model", "gpt2")
    g.strs("tokenizer.ggml.tokens", tokens)
    g.i32s("tokenizer.ggml.token_type", types)
    g.strs("tokenizer.ggml.merges", ["a b", "\u0120 a"])
    g.u32("tokenizer.ggml.bos_token_id", 0)
    g.u32("tokenizer.ggml.eos_token_id", 0)
    g.boolean("tokenizer.ggml.add_bos_token", 1)
    return len(tokens)


def synthetic_llama(rng, dim=32, hidden=32, layers=1, heads=2, kv_heads=1, types=(8, 2, 3, 1)):
    g = Gguf()
    g.s("general.architecture", "llama")
    g.s("general.name", "synthetic")
    g.u32("general.alignment", 32)
    g.u32("llama.embedding_length", dim)
    g.u32("llama.feed_forward_length", hidden)
    g.u32("llama.block_count", layers)
    g.u32("llama.attention.head_count", heads)
    g.u32("llama.attention.head_count_kv", kv_heads)
    g.u32("llama.context_length", 64)
    g.f32("llama.rope.freq_base", 10000.0)
    g.f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    vocab = tokenizer_kv(g)
    hd = dim // heads
    g.tensor("token_embd.weight", [dim, vocab], 0, block(0, dim * vocab, rng))
    for l in range(layers):
        p = "blk.%d." % l
        g.tensor(p + "attn_norm.weight", [dim], 0, block(0, dim, rng))
        g.tensor(p + "ffn_norm.weight", [dim], 0, block(0, dim, rng))
        g.tensor(p + "attn_q.weight", [dim, heads * hd], types[0], block(types[0], dim * heads * hd, rng))
        g.tensor(p + "attn_k.weight", [dim, kv_heads * hd], types[1], block(types[1], dim * kv_heads * hd, rng))
        g.tensor(p + "attn_v.weight", [dim, kv_heads * hd], types[2], block(types[2], dim * kv_heads * hd, rng))
        g.tensor(p + "attn_output.weight", [heads * hd, dim], types[3], block(types[3], dim * heads * hd, rng))
        g.tensor(p + "ffn_gate.weight", [dim, hidden], 3, block(3, dim * hidden, rng))
        g.tensor(p + "ffn_up.weight", [dim, hidden], 8, block(8, dim * hidden, rng))
        g.tensor(p + "ffn_down.weight", [hidden, dim], 30, block(30, dim * hidden, rng))
    g.tensor("output_norm.weight", [dim], 0, block(0, dim, rng))
    return g.build()


def gguf_seeds():
    rng = random.Random(1)
    write("gguf", "synthetic_llama.gguf", synthetic_llama(rng))
    write("gguf", "synthetic_llama_q4_0_f16.gguf", synthetic_llama(rng, types=(2, 1, 8, 0)))
    g = Gguf()
    tokenizer_kv(g, with_bytes=True)
    write("gguf", "tokenizer_only.gguf", g.build())
    write("gguf", "header_only_v2.gguf", Gguf(version=2).build())
    g = Gguf()
    g.u32("general.alignment", 64)
    g.i32("i32", -7)
    g.f64("f64", 2.5)
    g.u64("u64", 1 << 40)
    g.boolean("bool", 1)
    g.nested("nested.arrays")
    g.tensor("t.f32", [4, 2], 0, block(0, 8, rng))
    g.tensor("t.bf16", [4], 30, block(30, 4, rng))
    g.tensor("t.q8_0", [32], 8, block(8, 32, rng))
    write("gguf", "every_type.gguf", g.build(align=64))


# ---- llama2.c ----------------------------------------------------------------------------------

def llama2c_model(dim, hidden, layers, heads, kv_heads, vocab, ctx, tied, rng):
    head = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab if tied else -vocab, ctx)
    kv_dim = kv_heads * (dim // heads)
    n = vocab * dim + layers * (2 * dim + dim * dim + 2 * kv_dim * dim + dim * dim + 3 * hidden * dim)
    n += dim + 2 * ctx * (dim // heads) // 2 + (0 if tied else vocab * dim)
    return head + struct.pack("<%df" % n, *[rng.choice([-0.25, 0.0, 0.25, 1.0]) for _ in range(n)])


def llama2c_model_seeds():
    rng = random.Random(2)
    write("llama2c_model", "tiny_tied.bin", llama2c_model(8, 16, 1, 2, 1, 8, 4, True, rng))
    write("llama2c_model", "tiny_untied.bin", llama2c_model(8, 8, 2, 2, 2, 6, 2, False, rng))
    with open(os.path.join(DATA, "stories260K.bin"), "rb") as f:
        write("llama2c_model", "stories260K_head.bin", f.read(2048))


def llama2c_tokenizer_seeds():
    with open(os.path.join(DATA, "tok512.bin"), "rb") as f:
        tok512 = f.read()
    texts = [b"Once upon a time, there was a little girl named Lily.",
             "caf\u00e9 \u00fcber \U0001F600".encode() + b"\xff\xfe"]
    for i, text in enumerate(texts):
        write("llama2c_tokenizer", "tok512_%d" % i, struct.pack("<HH", 512, len(text)) + text + tok512)
    pieces = [b"<unk>", b"<s>", b"</s>", b" ", b"a", b"b", b"ab", b" ab", b"<0x41>"]
    body = struct.pack("<i", 8) + b"".join(struct.pack("<fi", -float(i), len(p)) + p
                                           for i, p in enumerate(pieces))
    text = b"ab ab abab A\x00z"
    write("llama2c_tokenizer", "tiny_vocab", struct.pack("<HH", len(pieces), len(text)) + text + body)


# ---- BPE text ----------------------------------------------------------------------------------

def bpe_seeds():
    texts = [
        (0, "In the beginning God created the heaven and the earth.\n"),
        (1, "<|im_start|>user\nWhat is the pass key? 12345<|im_end|>\n<|im_start|>assistant\n"),
        (0, "I'm here, you're there; they'll've  gone\t\ttabs   and    spaces 2024-11-23"),
        (0, "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001F600"),
        (1, "<|im_start|><|im_end|><|endoftext|><|im_start"),
    ]
    for i, (flag, text) in enumerate(texts):
        write("bpe_tokenizer", "text_%d" % i, bytes([flag]) + text.encode())
    write("bpe_tokenizer", "invalid_utf8", b"\x00\xc3(\xa0\xa1\xe2\x28\xa1\xf0\x90\x28\xbc\xff\xfe a")


# ---- safetensors -------------------------------------------------------------------------------

def safetensors(header_json, payload):
    h = header_json.encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + payload


def safetensors_seeds():
    T, H, D = 2, 2, 8
    q = struct.pack("<%df" % (T * H * D), *[0.5 * (i % 5) for i in range(T * H * D)])
    kv = struct.pack("<%df" % (T * D), *[0.25 * (i % 3) for i in range(T * D)])
    kv16 = struct.pack("<%dH" % (T * D), *[0x3F80 for _ in range(T * D)])
    toks = struct.pack("<2i", 1, 2)
    header = ('{"__metadata__":{"format":"kvferry-trace-v1","model":"t\\u00e9st \\ud83d\\ude00"},'
              '"layer.0.k":{"dtype":"F32","shape":[%d,1,%d],"data_offsets":[0,%d]},'
              '"layer.0.q":{"dtype":"F32","shape":[%d,%d,%d],"data_offsets":[%d,%d]},'
              '"layer.0.v":{"dtype":"BF16","shape":[%d,1,%d],"data_offsets":[%d,%d]},'
              '"tokens":{"dtype":"I32","shape":[2],"data_offsets":[%d,%d]}}') % (
        T, D, len(kv), T, H, D, len(kv), len(kv) + len(q), T, D, len(kv) + len(q),
        len(kv) + len(q) + len(kv16), len(kv) + len(q) + len(kv16),
        len(kv) + len(q) + len(kv16) + len(toks))
    write("safetensors", "trace.safetensors", safetensors(header, kv + q + kv16 + toks))
    write("safetensors", "empty_object.safetensors", safetensors("{}", b""))
    write("safetensors", "i64_f16.safetensors", safetensors(
        '{"a":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},'
        '"b":{"dtype":"F16","shape":[],"data_offsets":[16,18]},'
        '"c":{"dtype":"U8","shape":[0],"data_offsets":[18,18]}}',
        struct.pack("<2q", -1, 7) + b"\x00\x3c"))
    with open(os.path.join(DATA, "smollm2_reference.safetensors"), "rb") as f:
        ref = f.read()
    n = struct.unpack("<Q", ref[:8])[0]
    write("safetensors", "smollm2_reference_header_only.safetensors", ref[:8 + n])


# ---- command lines -----------------------------------------------------------------------------

def cli_seeds():
    lines = [
        "--model data/SmolLM2-135M-Instruct.Q4_1.gguf --text data/kjv.txt --report --chat "
        "--context 2048 --scored 256 --offset-lines 1000 --policy lfps --budget 256 --window 192 "
        "--backend auto --json out.json",
        "--model m.gguf --perplexity --text t.txt --context 4096 --scored 512 --policy "
        "streaming,oracle --budget 256,512 --backend host --kv-dtype bf16",
        "--model m.gguf --passkey --chat --text t.txt --lengths 2048,4096 --depths 0.1,0.5,0.9 "
        "--trials 2 --seed 7",
        "--model m.gguf --dump-trace t.safetensors --text t.txt --context 2048 --trace-layers 0,15,29 "
        "--trace-steps 32 --policy dense --trace-dtype bf16",
        "--model stories260K.bin --tokenizer tok512.bin --prompt Once --max-new 16 --temperature "
        "0.8 --top-p 0.9 --sinks 0 --bank-slots 64 --cpu-threads 2 --param r=0.95 --route cpu",
        "--model m --perplexity --text t --context -100",
        "--help",
    ]
    for i, line in enumerate(lines):
        write("cli", "args_%d" % i, "\0".join(line.split(" ")).encode())


if __name__ == "__main__":
    gguf_seeds()
    llama2c_model_seeds()
    llama2c_tokenizer_seeds()
    bpe_seeds()
    safetensors_seeds()
    cli_seeds()
