"""Writes llama.cpp's references for the Gemma 3 270M Q4_K_M test model
(scripts/fetch-gemma.sh), in the format of the SmolLM2 ones (../shared/README.md):
- tests/data/gemma3-270m-q4_k_m-greedy.jsonl: per prompt of
  tests/data/smollm2-q4_1-greedy.jsonl (same ids and texts; `chat` prompts rendered with
  the GGUF's own chat template and its generation prompt, left out when the GGUF has none,
  as this base model's has not), plus one raw prompt of ~800 tokens from the bench corpus
  (past the 512-token window of the local layers), llama.cpp's prompt ids (BOS as
  the GGUF asks), up to 48 greedy ids (stopping at an end-of-generation token), the top-2
  logit margin of every step and the first step's top 5;
- tests/data/gemma3-tokenizer.jsonl: the texts of tests/data/smollm2-tokenizer.jsonl
  tokenized with and without special-token parsing (no BOS), and their round trip.
For issue 27 items 2 and 4 (the gemma3 forward pass is not in duet yet).
llama.cpp 0.3.36 through llama-cpp-python, 2 threads, f16 KV, the whole prompt in one batch.
The files in tests/data were recorded on 2026-12-06 by an AVX2 build (AMD EPYC, no AVX-512),
unlike the SmolLM2 references (AVX-512): compare by the top-2-margin rule, not bit for bit.

Usage: .venv/llama/bin/python bench/gemma_references.py
"""
import json, os
import numpy as np
import jinja2
import llama_cpp as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, 'models/gemma-3-270m-q4_k_m.gguf')
STEPS = 48

llm = L.Llama(MODEL, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, logits_all=False, verbose=False)
n_vocab = llm.n_vocab()
template = llm.metadata.get('tokenizer.chat_template')
bos = llm.metadata.get('tokenizer.ggml.add_bos_token', 'true') == 'true'
eog = {t for t in range(n_vocab) if L.llama_vocab_is_eog(llm._model.vocab, t)}


def render(text):
    env = jinja2.Environment()
    tpl = env.from_string(template)
    return tpl.render(messages=[{'role': 'user', 'content': text}], add_generation_prompt=True,
                      bos_token=llm.detokenize([llm.token_bos()]).decode(), eos_token='')


# Past the 512-token window of Gemma 3's local layers: the opening of the bench corpus, to
# a paragraph end after ~3,500 characters (about 800 tokens).
corpus = open(os.path.join(ROOT, 'bench/data/persuasion-vol1.txt'), encoding='utf-8').read()
LONG = corpus[:corpus.index('\n\n', 3500)]
refs = [json.loads(line) for line in open(os.path.join(ROOT, 'tests/data/smollm2-q4_1-greedy.jsonl'))]
refs.append({'id': 'long-persuasion', 'kind': 'raw', 'prompt': LONG})

out = []
for ref in refs:
    chat = ref['kind'] == 'chat'
    if chat and not template:
        continue  # the GGUF carries no chat template: raw prompts only
    rendered = render(ref['prompt']) if chat else ref['prompt']
    # A rendered chat prompt carries its own BOS in the template.
    ids = llm.tokenize(rendered.encode(), add_bos=bos and not chat, special=chat)
    llm.reset()
    llm.eval(ids)
    greedy, margins, top5 = [], [], None
    for step in range(STEPS):
        lg = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).astype(np.float32)
        order = np.argsort(-lg, kind='stable')
        if step == 0:
            top5 = [[int(t), float(lg[t])] for t in order[:5]]
        margins.append(float(lg[order[0]] - lg[order[1]]))
        t = int(order[0])
        greedy.append(t)
        if t in eog:
            break
        llm.eval([t])
    out.append({'id': ref['id'], 'kind': ref['kind'], 'prompt': ref['prompt'], 'rendered_prompt': rendered,
                'prompt_ids': ids, 'greedy_ids': greedy,
                'greedy_text': llm.detokenize(greedy).decode('utf-8', errors='replace'),
                'top2_margin': margins, 'first_step_top5': top5})
with open(os.path.join(ROOT, 'tests/data/gemma3-270m-q4_k_m-greedy.jsonl'), 'w') as f:
    for r in out:
        f.write(json.dumps(r, ensure_ascii=False) + '\n')
toks = []
for line in open(os.path.join(ROOT, 'tests/data/smollm2-tokenizer.jsonl')):
    text = json.loads(line)['text']
    if toks and toks[-1]['text'] == text:
        continue
    for special in (False, True):
        ids = llm.tokenize(text.encode(), add_bos=False, special=special)
        toks.append({'text': text, 'parse_special': special, 'ids': ids,
                     'roundtrip': llm.detokenize(ids, special=special).decode('utf-8', errors='replace')})
with open(os.path.join(ROOT, 'tests/data/gemma3-tokenizer.jsonl'), 'w') as f:
    for r in toks:
        f.write(json.dumps(r, ensure_ascii=False) + '\n')
print('wrote', len(out), 'greedy references and', len(toks), 'tokenizer cases;',
      'llama.cpp', L.__version__, L.llama_print_system_info().decode().strip())
