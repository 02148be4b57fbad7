"""Writes tests/data/llama-cpp-kquant-vecdot.json: outputs of llama.cpp's own CPU
K-quant kernels (ggml-cpu's `quantize_row_q8_K` and `ggml_vec_dot_q{4,5,6}_K_q8_K`,
called through ctypes from the libggml-cpu.so that llama-cpp-python 0.3.36 builds), so
engine/tests/kquant.rs can check duet's Q8_K quantizer and vec_dot order bit for bit.

Weights: rows of two K-quant tensors of the Gemma 3 270M Q4_K_M file
(scripts/fetch-gemma.sh; Q4_K and Q6_K) and random Q5_K blocks (the file has none).
Activations: deterministic f32 rows with a few outliers, stored as hex.

Usage (llama-cpp-python 0.3.36 in .venv/llama, as scripts/bench-engine.sh builds it):
  .venv/llama/bin/python bench/llama_cpp_kquant_fixture.py
"""
import ctypes, glob, json, os
import sys
import numpy as np
import llama_cpp as L

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_cpp_kquant_matmul_fixture import random_blocks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEMMA = os.path.join(ROOT, 'models/gemma-3-270m-q4_k_m.gguf')
OUT = os.path.join(ROOT, 'tests/data/llama-cpp-kquant-vecdot.json')
Q4_K, Q5_K, Q6_K, Q8_K = 12, 13, 14, 15
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}
Q8K_BYTES = 4 + 256 + 32
ROWS = 16

libdir = os.path.join(os.path.dirname(L.__file__), 'lib')
cpu = ctypes.CDLL(glob.glob(os.path.join(libdir, 'libggml-cpu.so*'))[0])


class Traits(ctypes.Structure):
    _fields_ = [('from_float', ctypes.c_void_p), ('vec_dot', ctypes.c_void_p),
                ('vec_dot_type', ctypes.c_int), ('nrows', ctypes.c_int64)]


cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
cpu.ggml_cpu_init()
FromFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VecDot = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                          ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def quantize_q8k(x):
    t = cpu.ggml_get_type_traits_cpu(Q8_K).contents
    out = ctypes.create_string_buffer(len(x) // 256 * Q8K_BYTES)
    xs = np.ascontiguousarray(x, dtype='<f4')
    FromFloat(t.from_float)(xs.ctypes.data, ctypes.addressof(out), len(x))
    return out.raw


def vec_dot(qtype, row, act, n):
    t = cpu.ggml_get_type_traits_cpu(qtype).contents
    assert t.vec_dot_type == Q8_K and t.nrows == 1
    s = ctypes.c_float()
    w = ctypes.create_string_buffer(row, len(row))
    a = ctypes.create_string_buffer(act, len(act))
    VecDot(t.vec_dot)(n, ctypes.addressof(s), 0, ctypes.addressof(w), 0, ctypes.addressof(a), 0, 1)
    return int(np.float32(s.value).view(np.uint32))


def activations(rows, cols, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype('<f4')
    x[rng.random((rows, cols)) < 0.004] *= 30.0
    return x


def main():
    from gguf import GGUFReader
    reader = GGUFReader(GEMMA)
    tensors = {t.name: t for t in reader.tensors}
    cases = []
    for name, qtype, src in [('blk.0.attn_output.weight', Q4_K, 'gemma'),
                             ('blk.0.ffn_down.weight', Q6_K, 'gemma'),
                             ('q5_k', Q5_K, 'random')]:
        if src == 'gemma':
            t = tensors[name]
            assert int(t.tensor_type) == qtype, (name, t.tensor_type)
            cols = int(t.shape[0])
            raw = np.asarray(t.data).reshape(-1).tobytes()
            rb = cols // 256 * BLOCK_BYTES[qtype]
            rows = [raw[j * rb:(j + 1) * rb] for j in range(ROWS)]
        else:
            # Random Q5_K rows of 4 blocks with sane f16 scales: enough outputs that
            # the fused and the unfused `summs` update of ggml's Q5_K kernel differ.
            rng = np.random.default_rng(5)
            cols, rb = 1024, 4 * BLOCK_BYTES[qtype]
            raw = random_blocks(rng, ROWS * 4, BLOCK_BYTES[qtype], (0, 2)).tobytes()
            rows = [raw[j * rb:(j + 1) * rb] for j in range(ROWS)]
        x = activations(3, cols, qtype)
        acts = [quantize_q8k(r) for r in x]
        dots = [[vec_dot(qtype, w, a, cols) for w in rows] for a in acts]
        cases.append({'weights': name, 'source': src, 'weights_hex': raw.hex() if src == 'random' else None, 'type': {Q4_K: 'q4_k', Q5_K: 'q5_k', Q6_K: 'q6_k'}[qtype],
                      'cols': cols, 'rows': len(rows),
                      'activations_f32_hex': [r.tobytes().hex() for r in x],
                      'q8k_hex': [a.hex() for a in acts],
                      'vec_dot_f32_bits': dots})
    json.dump({'llama_cpp_python': L.__version__, 'ggml_cpu': L.llama_print_system_info().decode().strip(),
               'cases': cases}, open(OUT, 'w'), indent=1)
    print('wrote', OUT)


if __name__ == '__main__':
    main()
