"""How well does llama.cpp itself follow its own greedy reference on this machine?

Runs llama.cpp (llama-cpp-python) with its default settings, with flash attention,
and with an f32 KV cache, and applies the reference's rule to each: tokens equal to
tests/data/smollm2-q4_1-greedy.jsonl before the first step whose top-2 margin is
below 0.05. This calibrates tests/greedy.rs. Usage (after scripts/bench-engine.sh
has built .venv/llama): .venv/llama/bin/python bench/llama_cpp_self_check.py
"""
import os
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, 'models/SmolLM2-135M-Instruct.Q4_1.gguf')
REFS = os.path.join(ROOT, 'tests/data/smollm2-q4_1-greedy.jsonl')
import sys, json, numpy as np
from llama_cpp import Llama
cfgs = {'default': {}, 'fa': dict(flash_attn=True), 'f32kv': dict(type_k=0, type_v=0)}
refs = [json.loads(l) for l in open(REFS)]
for name, extra in cfgs.items():
    llm = Llama(model_path=MODEL, n_ctx=2048, n_threads=2, verbose=False, **extra)
    res = []
    for r in refs:
        llm.reset(); llm.eval(r['prompt_ids'])
        out = []
        for i in range(len(r['greedy_ids'])):
            lg = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            t = int(np.argmax(lg)); out.append(t)
            if t != r['greedy_ids'][i]: break
            llm.eval([t])
        m = r['top2_margin']; k = next((i for i, x in enumerate(m) if x < 0.05), len(m))
        div = next((i for i, (a, b) in enumerate(zip(out, r['greedy_ids'])) if a != b), None)
        res.append((r['id'], k, div, None if div is None else m[div]))
    print(name, [(i, k, d, mg) for i, k, d, mg in res])
    print(name, 'passes rule on', sum(1 for _, k, d, _ in res if d is None or d >= k), 'of', len(res))
