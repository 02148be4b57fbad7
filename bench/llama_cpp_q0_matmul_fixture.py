"""Writes tests/data/llama-cpp-q0-matmul.json: matmuls of the 32-value formats Q4_0, Q5_0,
Q5_1 and Q8_0 computed by llama.cpp's own CPU backend (one-op ggml graphs of
llama-cpp-python 0.3.36's libggml-cpu through ctypes, one thread: MatMul of
bench/llama_cpp_kquant_matmul_fixture.py), so engine/tests/q0_formats.rs can check duet's
integer kernels for them bit for bit at 1 to 11 activation rows (vec_dot, and llamafile's
tinyBLAS where llama.cpp takes it). Weights: rows of the Gemma 3 270M Q4_K_M file's Q5_0
and Q8_0 tensors (scripts/fetch-gemma.sh), random Q4_0 and Q5_1 blocks.

Usage: .venv/llama/bin/python bench/llama_cpp_q0_matmul_fixture.py
"""
import json, os, sys
import numpy as np
from gguf import GGUFReader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cpp_kquant_matmul_fixture as fx  # noqa: E402
import llama_cpp as L  # noqa: E402

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
            w = rng.integers(0, 256, size=(ROWS * cols // 32, nbytes), dtype=np.uint8)
            for b in w:
                for k, off in enumerate(offs):
                    v = np.float16(rng.uniform(1e-3, 0.05) * (-1 if k == 1 else 1))
                    b[off:off + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
            w = w.reshape(ROWS, -1)
        else:
            t = tensors[name]
            assert int(t.tensor_type) == qtype, (name, t.tensor_type)
            cols = int(t.shape[0])
            w = np.asarray(t.data).reshape(int(t.shape[1]), -1)[:ROWS]
        if cols not in acts:
            x = rng.standard_normal((max(fx.N_ROWS), cols)).astype('<f4')
            x[rng.random(x.shape) < 0.004] *= 30.0
            acts[cols] = x
        for n in fx.N_ROWS:
            y = fx.matmul(qtype, w, ROWS, cols, acts[cols][:n], False)
            cases.append({'weights': name, 'type': NAMES[qtype], 'rows': ROWS, 'cols': cols, 'n': n,
                          'weights_hex': w.tobytes().hex() if name == 'random' else None,
                          'out_f32_bits': [[int(v) for v in r.view(np.uint32)] for r in y]})
    json.dump({'llama_cpp_python': L.__version__, 'ggml_cpu': L.llama_print_system_info().decode().strip(),
               'threads': 1,
               'activations_f32_hex': {str(c): x.tobytes().hex() for c, x in acts.items()},
               'cases': cases}, open(OUT, 'w'))
    print('wrote', OUT, len(cases), 'cases')


if __name__ == '__main__':
    main()
