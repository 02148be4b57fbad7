"""Times llama.cpp's CPU backend on one weight matrix of a GGUF file, as `duet bench
matmul` times duet's kernels: `y = x W^T` for `rows` activation rows, a one-op ggml
graph (bench/llama_cpp_kquant_matmul_fixture.py's MatMul; the weight in the CPU_REPACK
buffer where llama.cpp would put it: Q4_K with a multiple of 8 rows), median of
`--repeat` runs after one warm-up. Prints one JSON object. Used by scripts/bench-kquant.sh.

Usage: .venv/llama/bin/python bench/llama_cpp_matmul_speed.py --model M --tensor T \
         --rows 1,4,16,128 --threads 1 --repeat 9
"""
import argparse, json, os, sys, time
import numpy as np
from gguf import GGUFReader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cpp_kquant_matmul_fixture as fx  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument('--model', required=True)
ap.add_argument('--tensor', required=True)
ap.add_argument('--rows', default='1,4,16,128')
ap.add_argument('--threads', type=int, default=1)
ap.add_argument('--repeat', type=int, default=9)
a = ap.parse_args()
t = {t.name: t for t in GGUFReader(a.model).tensors}[a.tensor]
qtype, cols, rows = int(t.tensor_type), int(t.shape[0]), int(t.shape[1])
w = np.asarray(t.data).reshape(rows, -1)
repack = qtype == fx.Q4_K and rows % 8 == 0
points = []
for n in map(int, a.rows.split(',')):
    x = ((np.arange(n * cols, dtype=np.int64) * 7919 % 2003) / 2003.0 - 0.5).astype('<f4').reshape(n, cols) * 2
    m = fx.MatMul(qtype, w, rows, cols, x, repack, a.threads)
    m.compute()
    times = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        m.compute()
        times.append((time.perf_counter() - t0) * 1e3)
    m.close()
    points.append({'rows': n, 'llama_cpp_ms': float(np.median(times))})
print(json.dumps({'tensor': a.tensor, 'type': t.tensor_type.name.lower(), 'shape': [rows, cols],
                  'threads': a.threads, 'repacked': repack, 'points': points}))
