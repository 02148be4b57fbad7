#!/usr/bin/env python3
"""Writes tests/data/kquant-reference.json: ggml's reference dequantization of
K-quant blocks, as computed by gguf-py (ggml-org's own Python port of
`dequantize_row_q*_K`, pinned: pip install gguf==0.19.0 numpy), for the
engine's tests (engine/tests/kquant.rs):

- `random`: per format (q4_k, q5_k, q6_k), blocks of random bytes with sane f16
  scales, and their dequantized values as f32 bit patterns;
- `gemma`: per K-quant tensor of the Gemma 3 270M Q4_K_M file
  (scripts/fetch-gemma.sh), its type, shape and the sha256 of its dequantized
  values (f32, little-endian, row-major).

Usage: python3 scripts/kquant_reference.py [models/gemma-3-270m-q4_k_m.gguf]
"""
import hashlib
import json
import pathlib
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCKS = 8
LAYOUT = {  # name: (type, block bytes, offsets of f16 scales)
    "q4_k": (GGMLQuantizationType.Q4_K, 144, [0, 2]),
    "q5_k": (GGMLQuantizationType.Q5_K, 176, [0, 2]),
    "q6_k": (GGMLQuantizationType.Q6_K, 210, [208]),
}


def random_blocks(rng, nbytes, scale_offsets):
    raw = rng.integers(0, 256, size=(BLOCKS, nbytes), dtype=np.uint8)
    for b in range(BLOCKS):
        for k, off in enumerate(scale_offsets):
            # Magnitudes a real file has, both signs (a negative d is legal).
            v = np.float16(rng.uniform(1e-4, 0.05) * (-1 if (b + k) % 5 == 4 else 1))
            raw[b, off:off + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
    return raw


def main():
    rng = np.random.default_rng(20261206)
    out = {"generator": "gguf-py 0.19.0 gguf.quants.dequantize", "random": {}, "gemma": []}
    for name, (qtype, nbytes, offs) in LAYOUT.items():
        raw = random_blocks(rng, nbytes, offs)
        vals = dequantize(raw.reshape(-1), qtype).astype(np.float32).reshape(-1)
        out["random"][name] = {
            "blocks_hex": raw.tobytes().hex(),
            "values_f32_bits": [int(v) for v in vals.view(np.uint32)],
        }
    gguf = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models/gemma-3-270m-q4_k_m.gguf"
    reader = GGUFReader(str(gguf))
    for t in reader.tensors:
        if t.tensor_type.name not in ("Q4_K", "Q5_K", "Q6_K"):
            continue
        vals = dequantize(np.asarray(t.data).reshape(-1), t.tensor_type).astype("<f4")
        out["gemma"].append({
            "name": t.name,
            "type": t.tensor_type.name.lower(),
            "shape": [int(t.shape[1]), int(t.shape[0])],  # rows, columns
            "dequant_sha256": hashlib.sha256(vals.tobytes()).hexdigest(),
        })
    path = ROOT / "tests/data/kquant-reference.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}: {len(out['gemma'])} Gemma tensors")


if __name__ == "__main__":
    main()
