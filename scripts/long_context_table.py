#!/usr/bin/env python3
"""Markdown tables of scripts/bench-long-context.sh's results.

    long_context_table.py ppl PPL.jsonl          # one `duet eval perplexity` line per policy
    long_context_table.py decode FULL.json WIN.json   # `duet bench engine` reports
"""
import json
import sys


def ppl(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    base = next(r for r in rows if r["attention"] == "full" and r["kv_dtype"] == "f16")
    print(f"ctx {base['ctx']}, {base['windows']} windows, {base['tokens_scored']} tokens scored")
    print()
    print("| attention | KV | PPL | vs full f16 | KV peak per sequence | vs full f16 | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        d = (r["ppl"] / base["ppl"] - 1) * 100
        m = (r["kv_bytes_peak"] / base["kv_bytes_peak"] - 1) * 100
        print(
            f"| {r['attention']} | {r['kv_dtype']} | {r['ppl']:.3f} ± {r['ppl_stderr']:.3f} "
            f"| {d:+.1f}% | {r['kv_bytes_peak'] / 2**20:.1f} MiB | {m:+.0f}% | {r['seconds']} |"
        )


def decode(paths):
    print("| context | attention | decode ms/token (batch 1, 1 thread) |")
    print("|---|---|---|")
    for path in paths:
        r = json.load(open(path))
        for d in r["decode"]:
            ms = 1000 * d["seconds"] / d["steps"]
            print(f"| {d['context']} | {r['attention']} | {ms:.1f} |")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("ppl", "decode"):
        sys.exit(__doc__)
    if sys.argv[1] == "ppl":
        ppl(sys.argv[2])
    else:
        decode(sys.argv[2:])
