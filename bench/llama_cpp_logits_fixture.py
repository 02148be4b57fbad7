"""Writes tests/data/llama-cpp-logits.json: llama.cpp's exact logits for a few reference
prompts and greedy decode steps, as the sha256 of the little-endian f32 vector plus the top
20 (id, logit), so engine/tests/bit_exact.rs can check that duet's exact form (quantized
weights, f16 KV) computes llama.cpp's CPU arithmetic bit for bit, prefill and decode.

DUET_MODEL and DUET_LOGITS_FIXTURE override the model and the output (scripts/check-kquant-llama.sh).

Usage (llama-cpp-python 0.3.36 in .venv/llama, as scripts/bench-engine.sh builds it, on
an AVX-512 CPU: GGML_NATIVE then compiles ggml's AVX-512 kernels, the build that recorded
tests/data/smollm2-q4_1-greedy.jsonl; the script refuses a build without them):
  .venv/llama/bin/python bench/llama_cpp_logits_fixture.py
llama.cpp runs with its defaults (f16 KV, no flash attention), 2 threads, the whole prompt
in one batch, then one token per decode call: the same shapes the reference was made with.
"""
import ctypes, hashlib, json, os
import numpy as np
import llama_cpp as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.environ.get('DUET_MODEL', os.path.join(ROOT, 'models/SmolLM2-135M-Instruct.Q4_1.gguf')).encode()
REFS = os.path.join(ROOT, 'tests/data/smollm2-q4_1-greedy.jsonl')
OUT = os.environ.get('DUET_LOGITS_FIXTURE', os.path.join(ROOT, 'tests/data/llama-cpp-logits.json'))
PROMPTS = ['v06-story', 'v04-chat-pd']
DECODE_STEPS = 3

L.llama_backend_init()
SYSTEM = L.llama_print_system_info().decode()
# DUET_FIXTURE_ANY_CPU=1 accepts another build (an AVX2-only CPU): its attention sums and
# expf round differently, so duet agrees with it closely, not bit for bit.
assert 'AVX512 = 1' in SYSTEM or os.environ.get('DUET_FIXTURE_ANY_CPU') == '1', \
    'llama.cpp was not built with AVX-512: ' + SYSTEM
model = L.llama_model_load_from_file(MODEL, L.llama_model_default_params())
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
refs = {r['id']: r for r in map(json.loads, open(REFS))}
cases = []
for pid in PROMPTS:
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 512
    cp.n_threads = cp.n_threads_batch = 2
    if hasattr(cp, 'flash_attn_type'):
        cp.flash_attn_type = 0
    ctx = L.llama_init_from_model(model, cp)
    feed = list(refs[pid]['prompt_ids'])
    steps = []
    for step in range(DECODE_STEPS + 1):
        arr = (L.llama_token * len(feed))(*feed)
        assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(feed))) == 0
        lg = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_vocab,)).astype('<f4')
        top = np.argsort(-lg, kind='stable')[:20]
        steps.append({'fed': feed, 'sha256': hashlib.sha256(lg.tobytes()).hexdigest(),
                      'top20': [[int(i), float(lg[i])] for i in top]})
        feed = [int(top[0])]
    cases.append({'id': pid, 'steps': steps})
    L.llama_free(ctx)
json.dump({'llama_cpp_python': L.__version__, 'ggml_cpu': SYSTEM.strip(), 'kv': 'f16', 'flash_attn': False,
           'threads': 2, 'cases': cases}, open(OUT, 'w'), indent=1)
print('wrote', OUT)
