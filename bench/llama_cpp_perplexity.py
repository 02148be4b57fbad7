#!/usr/bin/env python3
"""llama.cpp's perplexity of a GGUF over a text, from llama-cpp-python's logits.

The windows and sums of llama.cpp's `llama-perplexity` (default mode): the tokens (with BOS
when the model's tokenizer adds one) cut into consecutive windows of --ctx tokens, each
evaluated from an empty cache with its first token replaced by BOS (when added), the second
half scored: -log softmax(logits[j])[token j+1], expf summed in float64 after subtracting the
row's largest logit. Prints one JSON object like `duet eval perplexity --json`:

    {"ppl": ..., "ppl_stderr": ..., "nll": ..., "tokens_scored": N, "tokens_total": N,
     "windows": N, "ctx": N, "stride": 0, "llama_cpp_python": "0.3.36"}

Needs llama-cpp-python 0.3.36 and numpy (scripts/bench-engine.sh builds them into
.venv/llama; llama.cpp's AMX code must be left out on these VMs).
"""

import argparse
import json
import math
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--file", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None, help="at most this many windows")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import numpy as np
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=a.model,
        n_ctx=a.ctx,
        n_batch=a.ctx,
        n_threads=a.threads,
        logits_all=True,
        verbose=False,
    )
    text = open(a.file, encoding="utf-8").read()
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    bos = llm.token_bos()
    adds_bos = len(tokens) > 0 and tokens[0] == bos
    n = len(tokens)
    if n < 2 * a.ctx:
        print(f"{n} tokens; at least {2 * a.ctx} are needed", file=sys.stderr)
        return 1
    windows = n // a.ctx
    if a.chunks is not None:
        windows = min(windows, a.chunks)
    first = a.ctx // 2
    s = s2 = 0.0
    count = 0
    for i in range(windows):
        start = i * a.ctx
        window = list(tokens[start : start + a.ctx])
        if adds_bos:
            window[0] = bos
        llm.reset()
        llm.eval(window)
        scores = np.asarray(llm.scores[: a.ctx], dtype=np.float32)
        for j in range(first, a.ctx - 1):
            row = scores[j]
            mx = row.max()
            total = np.exp(row - mx, dtype=np.float32).astype(np.float64).sum()
            v = -(float(row[tokens[start + j + 1]] - mx) - math.log(total))
            s += v
            s2 += v * v
            count += 1
    mean = s / count
    ppl = math.exp(mean)
    var = s2 / count - mean * mean
    se = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    print(
        json.dumps(
            {
                "ppl": ppl,
                "ppl_stderr": se,
                "nll": mean,
                "tokens_scored": count,
                "tokens_total": n,
                "windows": windows,
                "ctx": a.ctx,
                "stride": 0,
                "llama_cpp_python": llama_cpp.__version__,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
