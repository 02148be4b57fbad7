"""How much llama.cpp's own Gemma 3 results move when only its batch split changes: the
first-step logits of the reference prompts (tests/data/gemma3-270m-q4_k_m-greedy.jsonl,
recorded with ubatches of 512) recomputed with ubatches of 7 and 64, and where its greedy
path then leaves the reference (with the reference's top-2 margin at that step). The noise
floor that engine/tests/gemma3.rs sizes its tolerances by.

Usage: .venv/llama/bin/python bench/gemma_llama_self_variation.py
"""
import json, os
import numpy as np
import llama_cpp as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, 'models/gemma-3-270m-q4_k_m.gguf')
cases = [json.loads(l) for l in open(os.path.join(ROOT, 'tests/data/gemma3-270m-q4_k_m-greedy.jsonl'))]
for ub in (7, 64):
    llm = L.Llama(MODEL, n_ctx=2048, n_batch=ub, n_ubatch=ub, n_threads=2, verbose=False)
    nv = llm.n_vocab()
    worst = 0.0
    for c in cases:
        llm.reset()
        llm.eval(c['prompt_ids'])
        got = []
        for step in range(len(c['greedy_ids'])):
            lg = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(nv,))
            if step == 0:
                d = [float(lg[t] - v) for t, v in c['first_step_top5']]
                worst = max(worst, max(abs(x) for x in d))
            t = int(np.argmax(lg))
            got.append(t)
            llm.eval([t])
        div = next((i for i, (a, b) in enumerate(zip(got, c['greedy_ids'])) if a != b), None)
        m = c['top2_margin']
        print(f"ubatch {ub:3} {c['id']:16} first-step top-5 moved by {' '.join(f'{x:+.3f}' for x in d)};"
              f" greedy leaves the reference at {div}"
              + ('' if div is None else f" (reference margin there {m[div]:.3f})"), flush=True)
    print(f"ubatch {ub:3}: largest first-step move {worst:.3f}")
