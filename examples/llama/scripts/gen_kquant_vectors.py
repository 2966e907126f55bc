#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Writes tests/data/gguf_kquant_vectors.bin: raw ggml blocks and the floats that the gguf Python
package's reference dequantisers (gguf/quants.py, a numpy port of ggml's) give for them.

The blocks are random bytes with their f16 scale fields replaced by finite random halves, so every
bit pattern of the quants, scales and mins is exercised. Format (little-endian):
  "KQV1", u32 entries; per entry: u32 ggml type, u32 elements, u32 bytes, the bytes, elements f32.
Run: /work/pyenv/bin/python examples/llama/scripts/gen_kquant_vectors.py [out]
"""
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

# type -> byte offsets of f16 fields inside one block
HALF_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/data/gguf_kquant_vectors.bin"
    rng = np.random.default_rng(51)
    entries = []
    for qtype, halves in HALF_FIELDS.items():
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        nblocks = 6 if block_elems == 256 else 16
        raw = rng.integers(0, 256, size=(nblocks, block_bytes), dtype=np.uint8)
        for off in halves:
            h = (rng.standard_normal(nblocks) * rng.choice([1e-3, 1e-2, 0.1, 1.0], nblocks))
            h = h.astype(np.float16).view(np.uint8).reshape(nblocks, 2)
            raw[:, off:off + 2] = h
        data = raw.reshape(-1)
        ref = dequantize(data, qtype).astype(np.float32).reshape(-1)
        assert ref.size == nblocks * block_elems and np.all(np.isfinite(ref))
        entries.append((int(qtype), ref.size, data.tobytes(), ref.tobytes()))
    with open(out, "wb") as f:
        f.write(b"KQV1" + struct.pack("<I", len(entries)))
        for qtype, n, data, ref in entries:
            f.write(struct.pack("<III", qtype, n, len(data)) + data + ref)
    print(out, sum(12 + len(d) + len(r) for _, _, d, r in entries) + 8, "bytes")


if __name__ == "__main__":
    main()
