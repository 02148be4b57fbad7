"""A float64 forward of Gemma 3 270M Q4_K_M (scripts/fetch-gemma.sh) from its dequantized
weights, written from the model's definition (embedding times sqrt(hidden); RMS norms whose
GGUF weights carry Gemma's +1; per-head query and key norms; NeoX RoPE, base 10,000 on the
local layers and 1e6 on every 6th (global) layer; queries scaled by 1/sqrt(256); local
layers see their last 512 positions; GELU-tanh gated feed-forward; norms after attention and
feed-forward; tied output). No activation quantization, no ggml rounding: what the
arithmetic tends to, to tell a real disagreement (a wrong mask, norm or RoPE moves logits
by whole units) from rounding noise (tenths).

For each reference prompt of tests/data/gemma3-270m-q4_k_m-greedy.jsonl it prints the
first-step logits of llama.cpp's top 5 tokens, exact and as llama.cpp recorded them.
WIN=100000 turns the local window off (to see what the mask is worth).

Usage: .venv/llama/bin/python bench/gemma_exact_reference.py [prompt ids...]
"""
import json, os, sys
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
r = GGUFReader(os.path.join(ROOT, 'models/gemma-3-270m-q4_k_m.gguf'))
T = {t.name: t for t in r.tensors}
H, NL, HD, NH, NKV, EPS = 640, 18, 256, 4, 1, 1e-6
WIN = int(os.environ.get('WIN', '512'))


def W(name):
    t = T[name]
    return dequantize(t.data, t.tensor_type).astype(np.float64)


def rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def rope(x, pos, base):  # x [tokens, heads, HD]; NeoX pairs (i, i + HD/2)
    half = HD // 2
    ang = np.outer(pos, base ** (-np.arange(half) * 2.0 / HD))[:, None, :]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


emb = W('token_embd.weight')
NAMES = ['attn_norm', 'attn_q', 'attn_k', 'attn_v', 'attn_q_norm', 'attn_k_norm', 'attn_output',
         'post_attention_norm', 'ffn_norm', 'ffn_gate', 'ffn_up', 'ffn_down', 'post_ffw_norm']
layers = [{k: W(f'blk.{i}.{k}.weight') for k in NAMES} for i in range(NL)]
out_norm = W('output_norm.weight')


def forward(ids):
    n = len(ids)
    pos = np.arange(n)
    x = emb[ids] * float(np.sqrt(np.float32(H)))
    for i, l in enumerate(layers):
        local = i % 6 < 5
        h = rms(x, l['attn_norm'])
        q = rms((h @ l['attn_q'].T).reshape(n, NH, HD), l['attn_q_norm'])
        k = rms((h @ l['attn_k'].T).reshape(n, NKV, HD), l['attn_k_norm'])
        v = (h @ l['attn_v'].T).reshape(n, NKV, HD)
        base = 10000.0 if local else 1e6
        q, k = rope(q, pos, base), rope(k, pos, base)
        k, v = np.repeat(k, NH // NKV, 1), np.repeat(v, NH // NKV, 1)
        s = np.einsum('thd,shd->hts', q, k) / np.sqrt(HD)
        mask = pos[None, :] > pos[:, None]
        if local:
            mask |= (pos[:, None] - pos[None, :]) >= WIN
        s[:, mask] = -np.inf
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum('hts,shd->thd', s, v).reshape(n, NH * HD)
        x = x + rms(o @ l['attn_output'].T, l['post_attention_norm'])
        h = rms(x, l['ffn_norm'])
        x = x + rms((gelu(h @ l['ffn_gate'].T) * (h @ l['ffn_up'].T)) @ l['ffn_down'].T,
                    l['post_ffw_norm'])
    return rms(x[-1], out_norm) @ emb.T


for line in open(os.path.join(ROOT, 'tests/data/gemma3-270m-q4_k_m-greedy.jsonl')):
    c = json.loads(line)
    if len(sys.argv) > 1 and c['id'] not in sys.argv[1:]:
        continue
    lg = forward(c['prompt_ids'])
    print(f"{c['id']:16}", ' '.join(f"{t}: exact {lg[t]:.3f} llama.cpp {v:.3f}"
                                    for t, v in c['first_step_top5']), flush=True)
