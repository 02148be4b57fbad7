#!/usr/bin/env python3
"""Side-by-side table of `duet bench engine` and bench/llama_cpp_engine.py.

Usage: compare_engine.py RESULT.json [RESULT.json ...] [--out PATH]

Takes any number of JSON reports (duet's and llama.cpp's, any thread counts),
pairs them by thread count, prints a markdown table per thread count and
writes the same text to bench/results/engine-<date>.md (or --out).
Standard library only.
"""

import argparse
import datetime
import json
import os
import sys

DUET = "duet"
LLAMA = "llama.cpp"
MIB = 1024 * 1024
LOW_CPU_UTIL = 0.9  # below this, the run shared its cores with something else


def load(paths):
    """{threads: {engine: (path, report)}}; a later file wins a duplicate."""
    by_threads = {}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        engine, threads = r.get("engine"), r.get("threads")
        if engine not in (DUET, LLAMA) or not isinstance(threads, int):
            sys.exit(f"compare_engine: {p}: not an engine bench report (engine={engine!r}, threads={threads!r})")
        prev = by_threads.setdefault(threads, {}).get(engine)
        if prev:
            print(f"compare_engine: {p} replaces {prev[0]} ({engine}, threads {threads})", file=sys.stderr)
        by_threads[threads][engine] = (p, r)
    return by_threads


def num(x, digits=1):
    return "—" if x is None else f"{x:,.{digits}f}"


def ratio(a, b):
    return f"{a / b:.2f}×" if a is not None and b else "—"


def prefill_map(r):
    return {e["tokens"]: e.get("tok_per_s") for e in (r or {}).get("prefill", [])}


def decode_map(r):
    return {(e["batch"], e["context"]): e for e in (r or {}).get("decode", [])}


def mib(r, key):
    v = (r or {}).get(key)
    return None if v is None else v / MIB


def table_for(threads, duet, llama):
    out = [f"## {threads} thread{'s' if threads != 1 else ''}", ""]
    notes = []
    dp, lp = prefill_map(duet), prefill_map(llama)
    dd, ld = decode_map(duet), decode_map(llama)

    out += ["| metric | duet tok/s | llama.cpp tok/s | duet / llama.cpp |", "|---|---:|---:|---:|"]
    for n in sorted(set(dp) | set(lp)):
        d, l = dp.get(n), lp.get(n)
        out.append(f"| prefill {n} tokens | {num(d)} | {num(l)} | {ratio(d, l)} |")
    for b, c in sorted(set(dd) | set(ld)):
        d = dd.get((b, c), {}).get("tok_per_s")
        l = ld.get((b, c), {}).get("tok_per_s")
        out.append(f"| decode batch {b}, context {c} (aggregate) | {num(d)} | {num(l)} | {ratio(d, l)} |")
        for name, m in ((DUET, dd), (LLAMA, ld)):
            err = m.get((b, c), {}).get("error")
            if err:
                notes.append(f"{name} decode batch {b}: {err}")

    # Batched-decode scaling: aggregate at batch B over the same engine's batch 1.
    out += [
        "",
        "| decode scaling (aggregate tok/s over the same engine's batch 1) | duet | llama.cpp |",
        "|---|---:|---:|",
    ]
    rows = 0
    for b, c in sorted(set(dd) | set(ld)):
        if b == 1:
            continue
        cells = []
        for m in (dd, ld):
            base = m.get((1, c), {}).get("tok_per_s")
            v = m.get((b, c), {}).get("tok_per_s")
            cells.append(ratio(v, base))
        out.append(f"| batch {b} vs batch 1, context {c} | {cells[0]} | {cells[1]} |")
        rows += 1
    if rows == 0:
        out = out[:-3]

    out += ["", "| memory (lower is better) | duet MiB | llama.cpp MiB | duet / llama.cpp |", "|---|---:|---:|---:|"]
    for label, key in (
        ("RSS after model load", "rss_after_load_bytes"),
        ("KV pool / KV cache size", "kv_pool_bytes"),
        ("RSS with the KV pool allocated", "rss_with_kv_pool_bytes"),
    ):
        d, l = mib(duet, key), mib(llama, key)
        out.append(f"| {label} | {num(d)} | {num(l)} | {ratio(d, l)} |")
    d, l = mib(duet, "rss_with_kv_pool_bytes"), mib(llama, "rss_with_kv_pool_bytes")
    dk, lk = mib(duet, "kv_pool_bytes"), mib(llama, "kv_pool_bytes")
    d = None if d is None or dk is None else d - dk
    l = None if l is None or lk is None else l - lk
    out.append(f"| RSS with KV pool minus KV pool | {num(d)} | {num(l)} | {ratio(d, l)} |")

    # Context worth knowing when reading the numbers.
    if duet:
        extra = [f"weights {duet['weights']}" if "weights" in duet else None]
        extra.append(f"KV {duet['kv_dtype']}" if "kv_dtype" in duet else None)
        extra.append(f"decode steps {sorted({e['steps'] for e in duet.get('decode', [])})}")
        notes.append("duet: " + ", ".join(x for x in extra if x))
    if llama:
        extra = [
            f"llama-cpp-python {llama.get('llama_cpp_python', '?')}",
            f"flash_attn {llama.get('flash_attn', '?')}",
            f"KV {llama.get('kv_dtype', '?')}",
            f"decode steps {sorted({e['steps'] for e in llama.get('decode', [])})}",
        ]
        if "rss_before_load_bytes" in llama:
            extra.append(f"python interpreter + numpy RSS {llama['rss_before_load_bytes'] / MIB:.1f} MiB included")
        notes.append("llama.cpp: " + ", ".join(extra))
        busy = [
            f"prefill {e['tokens']}" for e in llama.get("prefill", []) if e.get("cpu_util", 1) < LOW_CPU_UTIL
        ] + [f"decode batch {e['batch']}" for e in llama.get("decode", []) if (e.get("cpu_util") or 1) < LOW_CPU_UTIL]
        if busy:
            notes.append(
                f"llama.cpp got under {LOW_CPU_UTIL:.0%} of its {threads} core(s) during: "
                + ", ".join(busy)
                + " (something else was running; rerun on an idle machine)"
            )
    if not duet:
        notes.append("no duet report for this thread count")
    if not llama:
        notes.append("no llama.cpp report for this thread count")
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="JSON reports from duet and llama_cpp_engine.py")
    ap.add_argument("--out", help="markdown output (default bench/results/engine-<date>.md)")
    args = ap.parse_args()

    by_threads = load(args.reports)
    now = datetime.datetime.now()
    lines = [
        f"# Engine benchmark: duet vs llama.cpp ({now:%Y-%m-%d %H:%M})",
        "",
        "Same GGUF, same thread count, each engine pinned to the same cores. "
        "Decode tok/s is aggregate over the batch (batch × steps / seconds); "
        "throughput ratios above 1 favour duet. "
        "Memory is resident set size (VmRSS) of each benchmark process.",
        "",
        "Inputs: " + ", ".join(f"`{os.path.relpath(p)}`" for p in args.reports),
        "",
    ]
    for threads in sorted(by_threads):
        pair = by_threads[threads]
        duet = pair.get(DUET, (None, None))[1]
        llama = pair.get(LLAMA, (None, None))[1]
        lines += table_for(threads, duet, llama) + [""]
    text = "\n".join(lines)
    print(text)

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = args.out or os.path.join(root, "bench", "results", f"engine-{now:%Y-%m-%d}.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(f"compare_engine: wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
