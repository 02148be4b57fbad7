#!/usr/bin/env python3
"""llama.cpp side of the engine benchmark (see scripts/bench-engine.sh).

Measures, with llama.cpp (through llama-cpp-python's low-level ctypes API) on
the same GGUF and thread count as `duet bench engine`:

  prefill  tok/s for 128/512/1024-token prompts, each prompt one llama_decode
           call (n_batch = n_ubatch = 1024); median of 3 runs after 1 warm-up.
  decode   aggregate tok/s at batch 1/4/16/64: B sequences (distinct seq ids,
           each with its own 512-token prompt in the KV cache), then S timed
           steps, each step one llama_decode call holding one token per
           sequence, the next token being the greedy argmax of that sequence's
           logits. tok/s = B * S / seconds.
  rss      VmRSS after the model is loaded (no context yet) and with the decode
           context alive. That one context serves every batch size (n_seq_max
           = largest batch); its f16 KV cache is sized like duet's 1 GiB KV
           pool (per-sequence size rounded up to llama.cpp's 256 cells) and
           holds at least largest batch * (512 + S + 1) tokens.

Writes the same JSON shape as `duet bench engine --json`, with
"engine": "llama.cpp" and a few extra informational keys.

Prompts are the same token ids duet uses (cli/src/cmd/bench/engine.rs):
1000 + (i * 7919 + salt * 104729) % 40000, salt 0 for prefill and i + 1 for
decode sequence i.

Usage: llama_cpp_engine.py --model PATH --threads N --json OUT [--steps S]
       [--prefill 128,512,1024] [--batch 1,4,16,64] [--context 512]
"""

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import llama_cpp
import llama_cpp.llama_cpp as L

PREFILL_RUNS = 3
MIN_PREFILL_BATCH = 1024
# Deterministic prompts of ordinary vocabulary ids, exactly duet's.
ID_BASE = 1000
ID_SPAN = 40_000
# ggml.h log levels: 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT(inue previous).
# (llama_cpp/_logger.py documents an older numbering.)
GGML_LOG_WARN = 3
GGML_LOG_CONT = 5


def prompt_ids(n, salt):
    """duet's `tokens(n, salt)`."""
    return [ID_BASE + (i * 7919 + salt * 104_729) % ID_SPAN for i in range(n)]


def int_list(text):
    try:
        v = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return v


def rss_bytes():
    """Current resident set size (Linux /proc; falls back to peak RSS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_log_state = {"verbose": False, "last": 0}


@L.llama_log_callback
def _log_cb(level, text, _user):
    # Keep warnings and errors (and their continuation lines); all with --verbose.
    if level != GGML_LOG_CONT:
        _log_state["last"] = level
    if _log_state["verbose"] or _log_state["last"] >= GGML_LOG_WARN:
        sys.stderr.write(text.decode("utf-8", "replace"))
        sys.stderr.flush()


class Batch:
    """An owned llama_batch with numpy views over its token/pos/logits arrays."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.b = L.llama_batch_init(capacity, 0, 1)
        self.token = np.ctypeslib.as_array(self.b.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(self.b.pos, shape=(capacity,))
        self.n_seq_id = np.ctypeslib.as_array(self.b.n_seq_id, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(
            ctypes.cast(self.b.logits, ctypes.POINTER(ctypes.c_int8)), shape=(capacity,)
        )
        self._seq = [None] * capacity

    def set_seq(self, i, seq):
        if self._seq[i] != seq:
            self.b.seq_id[i][0] = seq
            self._seq[i] = seq

    def fill_one_seq(self, tokens, pos0, seq, last_logits=True):
        n = len(tokens)
        assert n <= self.capacity
        self.token[:n] = tokens
        self.pos[:n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.n_seq_id[:n] = 1
        self.logits[:n] = 0
        if last_logits:
            self.logits[n - 1] = 1
        for i in range(n):
            self.set_seq(i, seq)
        self.b.n_tokens = n

    def fill_one_token_per_seq(self, tokens, pos):
        """Token i belongs to seq i at position pos; every token gets logits."""
        n = len(tokens)
        assert n <= self.capacity
        self.token[:n] = tokens
        self.pos[:n] = pos
        self.n_seq_id[:n] = 1
        self.logits[:n] = 1
        for i in range(n):
            self.set_seq(i, i)
        self.b.n_tokens = n

    def free(self):
        if self.b is not None:
            L.llama_batch_free(self.b)
            self.b = None


def decode(ctx, batch):
    rc = L.llama_decode(ctx, batch.b)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} (n_tokens={batch.b.n_tokens})")
    L.llama_synchronize(ctx)


def context_params(threads, n_ctx, n_batch, n_seq_max, flash_attn):
    p = L.llama_context_default_params()
    p.n_ctx = n_ctx
    p.n_batch = n_batch
    p.n_ubatch = n_batch
    p.n_seq_max = n_seq_max
    # One KV stream per sequence (llama.cpp's default): each sequence attends
    # over its own cells only, not over every sequence's cells under a mask.
    p.kv_unified = False
    p.n_threads = threads
    p.n_threads_batch = threads
    p.flash_attn_type = {
        "auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO,
        "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    }[flash_attn]
    p.no_perf = True
    return p


def new_context(model, params):
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(
            f"llama_init_from_model failed (n_ctx={params.n_ctx}, n_seq_max={params.n_seq_max})"
        )
    return ctx


def timed(fn):
    """(result, wall seconds, process CPU seconds) of fn()."""
    c0, t0 = time.process_time(), time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0, time.process_time() - c0


def bench_prefill(model, args, log):
    max_len = max(args.prefill)
    n_batch = max(max_len, MIN_PREFILL_BATCH)  # every prompt is one ubatch
    ctx = new_context(model, context_params(args.threads, max_len, n_batch, 1, args.flash_attn))
    mem = L.llama_get_memory(ctx)
    batch = Batch(max_len)
    results = []
    try:
        for n in args.prefill:
            batch.fill_one_seq(prompt_ids(n, 0), 0, 0)
            walls, cpus = [], []
            for run in range(1 + PREFILL_RUNS):
                L.llama_memory_clear(mem, True)
                _, wall, cpu = timed(lambda: decode(ctx, batch))
                if run > 0:  # run 0 warms up
                    walls.append(wall)
                    cpus.append(cpu)
            med = statistics.median(walls)
            util = sum(cpus) / sum(walls) / args.threads
            results.append(
                {
                    "tokens": n,
                    "seconds": med,
                    "tok_per_s": n / med,
                    "runs_seconds": walls,
                    "cpu_util": round(util, 3),
                }
            )
            log(f"prefill {n:5d} tokens: {n / med:9.1f} tok/s  (median of {PREFILL_RUNS}, {med:.4f} s, cpu util {util:.2f})")
    finally:
        batch.free()
        L.llama_free(ctx)
    return results


def bench_decode(model, args, n_vocab, kv_bytes_per_token, log):
    """One context for every batch size: n_seq_max = the largest batch, one KV
    stream per sequence, KV sized like duet's pool (and at least enough for
    every sequence). Returns (results, rss with the context alive, kv bytes, info)."""
    ctx_len, steps = args.context, args.steps
    max_b = max(args.batch)
    per_seq = max(ctx_len + steps + 1, args.kv_pool_bytes // kv_bytes_per_token // max_b)
    per_seq = -(-per_seq // 256) * 256  # llama.cpp pads per-sequence context to 256
    n_batch = max(ctx_len, max_b)
    ctx = new_context(
        model, context_params(args.threads, per_seq * max_b, n_batch, max_b, args.flash_attn)
    )
    n_ctx = L.llama_n_ctx(ctx)
    n_ctx_seq = L.llama_n_ctx_seq(ctx)
    info = {"n_ctx": n_ctx, "n_ctx_seq": n_ctx_seq, "n_seq_max": max_b, "n_batch": n_batch, "kv_unified": False}
    prompt_batch = Batch(ctx_len)
    step_batch = Batch(max_b)
    first_token = {}  # seq -> greedy token after its prompt
    results = []
    try:
        if n_ctx_seq < ctx_len + steps + 1:
            raise RuntimeError(f"per-sequence context {n_ctx_seq} < {ctx_len + steps + 1}")
        mem = L.llama_get_memory(ctx)
        L.llama_memory_clear(mem, True)
        for b in args.batch:
            entry = {"batch": b, "context": ctx_len, "steps": steps}
            try:
                # Untimed: every sequence gets its own prompt (duet's salt
                # s + 1), prefilled once and kept across batch sizes; what an
                # earlier batch size decoded past the prompt is dropped.
                for s in range(b):
                    if s not in first_token:
                        prompt_batch.fill_one_seq(prompt_ids(ctx_len, s + 1), 0, s)
                        decode(ctx, prompt_batch)
                        lg = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
                        first_token[s] = int(lg.argmax())
                    if not L.llama_memory_seq_rm(mem, s, ctx_len, -1):
                        raise RuntimeError(f"llama_memory_seq_rm failed for seq {s}")
                start = np.array([first_token[s] for s in range(b)], dtype=np.int32)

                def run_steps(n_steps):
                    tokens, seq0 = start, []
                    for k in range(n_steps):
                        step_batch.fill_one_token_per_seq(tokens, ctx_len + k)
                        decode(ctx, step_batch)
                        # Outputs in batch order: row i is sequence i.
                        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(b, n_vocab))
                        tokens = logits.argmax(axis=1).astype(np.int32)
                        seq0.append(int(tokens[0]))
                    return seq0

                run_steps(1)  # warm-up, then rewind to exactly ctx_len tokens
                for s in range(b):
                    L.llama_memory_seq_rm(mem, s, ctx_len, -1)
                seq0, wall, cpu = timed(lambda: run_steps(steps))
                util = cpu / wall / args.threads
                entry.update(
                    {
                        "seconds": wall,
                        "tok_per_s": b * steps / wall,
                        "cpu_util": round(util, 3),
                        "seq0_tokens": seq0[:8],
                    }
                )
                log(f"decode batch {b:3d} @ ctx {ctx_len}: {b * steps / wall:9.1f} tok/s aggregate  ({steps} steps, {wall:.3f} s, cpu util {util:.2f})")
            except Exception as e:  # report it, keep the other batch sizes
                entry.update({"seconds": None, "tok_per_s": None, "error": f"{type(e).__name__}: {e}"})
                log(f"decode batch {b}: FAILED: {entry['error']}")
            results.append(entry)
        rss_with_kv = rss_bytes()
    finally:
        prompt_batch.free()
        step_batch.free()
        L.llama_free(ctx)
    return results, rss_with_kv, n_ctx * kv_bytes_per_token, info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size (default 32)")
    ap.add_argument("--prefill", type=int_list, default=[128, 512, 1024], help="prompt lengths (default 128,512,1024)")
    ap.add_argument("--batch", type=int_list, default=[1, 4, 16, 64], help="decode batch sizes (default 1,4,16,64)")
    ap.add_argument("--context", type=int, default=512, help="tokens per sequence before the timed decode steps (default 512)")
    ap.add_argument(
        "--kv-pool-bytes",
        type=int,
        default=1 << 30,
        help="size the decode context's KV cache like duet's KV pool (default 1 GiB)",
    )
    ap.add_argument(
        "--flash-attn",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp flash attention (default auto, llama.cpp's own default)",
    )
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    args = ap.parse_args()
    if args.threads < 1 or args.steps < 1 or args.context < 1:
        ap.error("--threads, --steps and --context must be >= 1")
    if max(args.batch) > L.llama_max_parallel_sequences():
        ap.error(f"largest --batch exceeds llama.cpp's {L.llama_max_parallel_sequences()} sequences")

    def log(msg):
        print(f"llama.cpp[t={args.threads}]: {msg}", file=sys.stderr, flush=True)

    _log_state["verbose"] = args.verbose
    L.llama_log_set(_log_cb, ctypes.c_void_p(0))
    L.llama_backend_init()

    rss_before_load = rss_bytes()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = L.llama_model_load_from_file(args.model.encode(), mparams)
    if not model:
        sys.exit(f"llama_cpp_engine: could not load {args.model}")
    rss_after_load = rss_bytes()

    try:
        vocab = L.llama_model_get_vocab(model)
        n_vocab = L.llama_vocab_n_tokens(vocab)
        if ID_BASE + ID_SPAN > n_vocab:
            sys.exit(f"llama_cpp_engine: vocab of {n_vocab} too small for ids {ID_BASE}..{ID_BASE + ID_SPAN}")
        n_layer = L.llama_model_n_layer(model)
        n_head = L.llama_model_n_head(model)
        n_head_kv = L.llama_model_n_head_kv(model)
        n_embd = L.llama_model_n_embd(model)
        # K and V, f16 (llama.cpp's default type_k/type_v), every layer.
        kv_bytes_per_token = n_layer * 2 * (n_embd // n_head) * n_head_kv * 2

        prefill = bench_prefill(model, args, log)
        decode_results, rss_with_kv, kv_bytes, decode_info = bench_decode(
            model, args, n_vocab, kv_bytes_per_token, log
        )
    finally:
        L.llama_model_free(model)
    log(
        f"RSS after load {rss_after_load / 2**20:.1f} MiB, with a {kv_bytes / 2**20:.0f} MiB KV cache "
        f"{rss_with_kv / 2**20:.1f} MiB (python itself: {rss_before_load / 2**20:.1f} MiB)"
    )

    out = {
        "engine": "llama.cpp",
        "threads": args.threads,
        "prefill": prefill,
        "decode": decode_results,
        "rss_after_load_bytes": rss_after_load,
        "rss_with_kv_pool_bytes": rss_with_kv,
        "kv_pool_bytes": kv_bytes,
        # Informational extras (not in duet's JSON).
        "rss_before_load_bytes": rss_before_load,
        "kv_dtype": "f16",
        "kv_bytes_per_token": kv_bytes_per_token,
        "decode_context": decode_info,
        "flash_attn": args.flash_attn,
        "model": os.path.abspath(args.model),
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
        "python": platform.python_version(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    os.replace(tmp, args.json)
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
