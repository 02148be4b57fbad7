"""Writes a K-quant variant of the default model: every `ffn_down` matrix of
SmolLM2-135M-Instruct Q4_1 (1536 columns, the model's only weights whose rows are
whole 256-value blocks) dequantized and re-quantized to Q4_K, Q5_K or Q6_K by
llama.cpp's own quantizer (`ggml_quantize_chunk` of the libggml-base that
llama-cpp-python 0.3.36 builds, called through ctypes); every other tensor and all
metadata copied unchanged (gguf-py's writer). With llama.cpp's logits for the
variant (bench/llama_cpp_logits_fixture.py) this checks duet's K-quant kernels and
llama.cpp's kernel choice (repacked Q4_K GEMM/GEMV, tiled Q5_K/Q6_K for prompts,
vec_dot for decode) end to end: scripts/check-kquant-llama.sh.

Usage: .venv/llama/bin/python bench/make_kquant_variant.py q4_k OUT.gguf
"""
import ctypes, glob, os, sys
import numpy as np
import gguf
import llama_cpp as L
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, 'models/SmolLM2-135M-Instruct.Q4_1.gguf')
TYPES = {'q4_k': (12, 144), 'q5_k': (13, 176), 'q6_k': (14, 210)}

base = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(L.__file__), 'lib', 'libggml-base.so*'))[0])
base.ggml_quantize_chunk.restype = ctypes.c_size_t
base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]


def quantize(x, qtype, block_bytes):
    rows, cols = x.shape
    out = np.zeros((rows, cols // 256 * block_bytes), dtype=np.uint8)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = base.ggml_quantize_chunk(qtype, x.ctypes.data, out.ctypes.data, 0, rows, cols, None)
    assert n == out.nbytes, (n, out.nbytes)
    return out


def main():
    kind, out_path = sys.argv[1], sys.argv[2]
    qtype, block_bytes = TYPES[kind]
    reader = gguf.GGUFReader(SRC)
    arch = reader.get_field('general.architecture').contents()
    writer = gguf.GGUFWriter(out_path, arch)
    for field in reader.fields.values():
        if field.name == 'general.architecture' or field.name.startswith('GGUF.'):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    datas = []
    for t in reader.tensors:
        if t.name.endswith('ffn_down.weight'):
            cols, rows = int(t.shape[0]), int(t.shape[1])
            x = dequantize(np.asarray(t.data).reshape(-1), t.tensor_type).reshape(rows, cols)
            data, ttype = quantize(x, qtype, block_bytes), gguf.GGMLQuantizationType(qtype)
        else:
            data, ttype = np.asarray(t.data), t.tensor_type
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, ttype)
        datas.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for d in datas:
        writer.write_tensor_data(d)
    writer.close()
    print('wrote', out_path)


if __name__ == '__main__':
    main()
