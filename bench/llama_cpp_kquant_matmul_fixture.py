"""Writes tests/data/llama-cpp-kquant-matmul.json: K-quant matmuls computed by
llama.cpp's own CPU backend (the libggml-cpu that llama-cpp-python 0.3.36 builds,
driven through ctypes: a one-op ggml graph `mul_mat(W, X)` on the CPU backend, one
thread), so engine/tests/kquant.rs can check that duet picks llama.cpp's kernel for
each row and computes it bit for bit:
- Q4_K with a multiple of 8 rows, stored in the CPU_REPACK buffer type as llama.cpp
  stores model weights: repacked GEMM for rows below n - n%4, GEMV for the rest;
- Q4_K with other row counts, Q5_K and Q6_K (never repacked on x86): the tiled
  kernel from 8 activation rows, vec_dot below.
Weights: rows of the Gemma 3 270M Q4_K_M file's Q4_K and Q6_K tensors
(scripts/fetch-gemma.sh) and random Q5_K blocks; activations f32, stored as hex.

Usage: .venv/llama/bin/python bench/llama_cpp_kquant_matmul_fixture.py
"""
import ctypes, glob, json, os
import numpy as np
import llama_cpp as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEMMA = os.path.join(ROOT, 'models/gemma-3-270m-q4_k_m.gguf')
OUT = os.path.join(ROOT, 'tests/data/llama-cpp-kquant-matmul.json')
Q4_K, Q5_K, Q6_K, F32 = 12, 13, 14, 0
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}
NAMES = {Q4_K: 'q4_k', Q5_K: 'q5_k', Q6_K: 'q6_k'}
N_ROWS = [1, 3, 6, 8, 11]

lib = os.path.join(os.path.dirname(L.__file__), 'lib')
base = ctypes.CDLL(glob.glob(os.path.join(lib, 'libggml-base.so*'))[0], mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(glob.glob(os.path.join(lib, 'libggml-cpu.so*'))[0], mode=ctypes.RTLD_GLOBAL)
P, I64, SZ = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t


class InitParams(ctypes.Structure):
    _fields_ = [('mem_size', SZ), ('mem_buffer', P), ('no_alloc', ctypes.c_bool)]


def fn(libh, name, res, *args):
    f = getattr(libh, name)
    f.restype, f.argtypes = res, list(args)
    return f


ggml_init = fn(base, 'ggml_init', P, InitParams)
ggml_free = fn(base, 'ggml_free', None, P)
new_2d = fn(base, 'ggml_new_tensor_2d', P, P, ctypes.c_int, I64, I64)
mul_mat = fn(base, 'ggml_mul_mat', P, P, P, P)
new_graph = fn(base, 'ggml_new_graph', P, P)
expand = fn(base, 'ggml_build_forward_expand', None, P, P)
alloc_size = fn(base, 'ggml_backend_buft_get_alloc_size', SZ, P, P)
alloc_buffer = fn(base, 'ggml_backend_buft_alloc_buffer', P, P, SZ)
buffer_base = fn(base, 'ggml_backend_buffer_get_base', P, P)
buffer_free = fn(base, 'ggml_backend_buffer_free', None, P)
tensor_alloc = fn(base, 'ggml_backend_tensor_alloc', ctypes.c_int, P, P, P)
tensor_set = fn(base, 'ggml_backend_tensor_set', None, P, P, SZ, SZ)
tensor_get = fn(base, 'ggml_backend_tensor_get', None, P, P, SZ, SZ)
graph_compute = fn(base, 'ggml_backend_graph_compute', ctypes.c_int, P, P)
backend_free = fn(base, 'ggml_backend_free', None, P)
cpu_buft = fn(base, 'ggml_backend_cpu_buffer_type', P)
repack_buft = fn(cpu, '_Z35ggml_backend_cpu_repack_buffer_typev', P)
cpu_init = fn(cpu, 'ggml_backend_cpu_init', P)
set_threads = fn(cpu, 'ggml_backend_cpu_set_n_threads', None, P, ctypes.c_int)
fn(cpu, 'ggml_cpu_init', None)()


def place(buft, t, data, buffers):
    buf = alloc_buffer(buft, alloc_size(buft, t))
    assert buf and tensor_alloc(buf, t, buffer_base(buf)) == 0
    buffers.append(buf)
    if data is not None:
        tensor_set(t, data.ctypes.data, 0, data.nbytes)


class MatMul:
    """`y = x W^T` as a one-op graph on llama.cpp's CPU backend; w uint8 [rows, row bytes]."""

    def __init__(self, qtype, w, rows, cols, x, repack, threads=1):
        self.n, self.rows = x.shape[0], rows
        self.ctx = ggml_init(InitParams(16 << 20, None, True))
        tw, tx = new_2d(self.ctx, qtype, cols, rows), new_2d(self.ctx, F32, cols, self.n)
        self.ty = mul_mat(self.ctx, tw, tx)
        self.graph = new_graph(self.ctx)
        expand(self.graph, self.ty)
        self.buffers = []
        place(repack_buft() if repack else cpu_buft(), tw, np.ascontiguousarray(w), self.buffers)
        place(cpu_buft(), tx, np.ascontiguousarray(x, dtype='<f4'), self.buffers)
        place(cpu_buft(), self.ty, None, self.buffers)
        self.backend = cpu_init()
        set_threads(self.backend, threads)

    def compute(self):
        assert graph_compute(self.backend, self.graph) == 0
        y = np.zeros((self.n, self.rows), dtype='<f4')
        tensor_get(self.ty, y.ctypes.data, 0, y.nbytes)
        return y

    def close(self):
        backend_free(self.backend)
        for b in self.buffers:
            buffer_free(b)
        ggml_free(self.ctx)


def matmul(qtype, w, rows, cols, x, repack):
    m = MatMul(qtype, w, rows, cols, x, repack)
    y = m.compute()
    m.close()
    return y


def random_blocks(rng, count, nbytes, offsets, negative=()):
    """`count` blocks of `nbytes` random bytes whose f16 scales at `offsets` have the
    magnitudes real files have (negated for the offsets' indices in `negative`)."""
    w = rng.integers(0, 256, size=(count, nbytes), dtype=np.uint8)
    for b in w:
        for k, off in enumerate(offsets):
            v = np.float16(rng.uniform(1e-3, 0.05) * (-1 if k in negative else 1))
            b[off:off + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
    return w


def add_cases(cases, acts, rng, name, type_name, qtype, w, rows, cols, repack=None):
    """Appends llama.cpp's `y = x W^T` for every row count of N_ROWS; the activations for
    `cols` columns are drawn once per fixture (a case takes their first n rows).
    `repack` None: not recorded (never repacked)."""
    if cols not in acts:
        x = rng.standard_normal((max(N_ROWS), cols)).astype('<f4')
        x[rng.random(x.shape) < 0.004] *= 30.0
        acts[cols] = x
    for n in N_ROWS:
        y = matmul(qtype, w, rows, cols, acts[cols][:n], bool(repack))
        case = {'weights': name, 'type': type_name, 'rows': rows, 'cols': cols}
        if repack is not None:
            case['repacked'] = repack
        case.update({'n': n, 'weights_hex': w.tobytes().hex() if name == 'random' else None,
                     'out_f32_bits': [[int(v) for v in r.view(np.uint32)] for r in y]})
        cases.append(case)


def write(out, cases, acts):
    json.dump({'llama_cpp_python': L.__version__, 'ggml_cpu': L.llama_print_system_info().decode().strip(),
               'threads': 1,
               # The first n rows of the matrix for `cols` columns are a case's activations.
               'activations_f32_hex': {str(c): x.tobytes().hex() for c, x in acts.items()},
               'cases': cases}, open(out, 'w'))
    print('wrote', out, len(cases), 'cases')


def main():
    from gguf import GGUFReader
    tensors = {t.name: t for t in GGUFReader(GEMMA).tensors}
    rng = np.random.default_rng(7)
    cases, acts = [], {}
    q5 = random_blocks(rng, 16 * 4, BLOCK_BYTES[Q5_K], (0, 2))
    for name, qtype, rows, repack in [('blk.0.attn_output.weight', Q4_K, 16, True),
                                      ('blk.0.attn_output.weight', Q4_K, 12, False),
                                      ('blk.0.ffn_down.weight', Q6_K, 16, False),
                                      ('random', Q5_K, 16, False)]:
        if name == 'random':
            cols, w = 1024, q5.reshape(16, -1)
        else:
            t = tensors[name]
            assert int(t.tensor_type) == qtype
            cols = int(t.shape[0])
            w = np.asarray(t.data).reshape(int(t.shape[1]), -1)[:rows]
        add_cases(cases, acts, rng, name, NAMES[qtype], qtype, w, rows, cols, repack)
    write(OUT, cases, acts)


if __name__ == '__main__':
    main()
