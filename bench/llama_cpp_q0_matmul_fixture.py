"""Writes tests/data/llama-cpp-q0-matmul.json: matmuls of the 32-value formats Q4_0, Q5_0,
Q5_1 and Q8_0 computed by llama.cpp's own CPU backend (one-op ggml graphs of
llama-cpp-python 0.3.36's libggml-cpu through ctypes, one thread: MatMul of
bench/llama_cpp_kquant_matmul_fixture.py), so engine/tests/q0_formats.rs can check duet's
integer kernels for them bit for bit at 1 to 11 activation rows (vec_dot, and llamafile's
tinyBLAS where llama.cpp takes it). Weights: rows of the Gemma 3 270M Q4_K_M file's Q5_0
and Q8_0 tensors (scripts/fetch-gemma.sh), random Q4_0 and Q5_1 blocks.

Usage: .venv/llama/bin/python bench/llama_cpp_q0_matmul_fixture.py
"""
import os, sys
import numpy as np
from gguf import GGUFReader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cpp_kquant_matmul_fixture as fx  # noqa: E402

ROOT = fx.ROOT
OUT = os.path.join(ROOT, 'tests/data/llama-cpp-q0-matmul.json')
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
NAMES = {Q4_0: 'q4_0', Q4_1: 'q4_1', Q5_0: 'q5_0', Q5_1: 'q5_1', Q8_0: 'q8_0'}
BLOCK = {Q4_0: (18, [0]), Q4_1: (20, [0, 2]), Q5_0: (22, [0]), Q5_1: (24, [0, 2])}
ROWS, COLS_RANDOM = 16, 640


def main():
    tensors = {t.name: t for t in GGUFReader(fx.GEMMA).tensors}
    rng = np.random.default_rng(32)
    cases, acts = [], {}
    for name, qtype in [('blk.0.attn_q.weight', Q5_0), ('blk.0.attn_v.weight', Q8_0),
                        ('random', Q4_0), ('random', Q5_1), ('random', Q4_1)]:
        if name == 'random':
            nbytes, offs = BLOCK[qtype]
            cols = COLS_RANDOM
            w = fx.random_blocks(rng, ROWS * cols // 32, nbytes, offs, negative=(1,)).reshape(ROWS, -1)
        else:
            t = tensors[name]
            assert int(t.tensor_type) == qtype, (name, t.tensor_type)
            cols = int(t.shape[0])
            w = np.asarray(t.data).reshape(int(t.shape[1]), -1)[:ROWS]
        fx.add_cases(cases, acts, rng, name, NAMES[qtype], qtype, w, ROWS, cols)
    fx.write(OUT, cases, acts)


if __name__ == '__main__':
    main()
