#!/usr/bin/env python3
"""Markdown tables of scripts/bench-long-context.sh's results.

    long_context_table.py ppl PPL.jsonl          # one `duet eval perplexity` line per policy
    long_context_table.py decode FULL.json WIN.json   # `duet bench engine` reports
    long_context_table.py serve SERVE.jsonl      # `duet bench serve` runs through `duet up`
    long_context_table.py steps REPORT.json...  # `duet bench engine` reports, one context
"""
import json
import statistics
import sys


def ppl(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    # Against full attention with f16 KV when the run has it (FULL_KV may skip it); rows
    # whose prompt KV went through a codec against the same evaluation without one.
    base = next((r for r in rows if r["attention"] == "full" and r["kv_dtype"] == "f16"
                 and r.get("kv_in_flight") in (None, "none")), rows[0])
    print(f"ctx {base['ctx']}, {base['windows']} windows, {base['tokens_scored']} tokens scored")
    print()
    print("| attention | KV | PPL | vs full f16 | KV peak per sequence | vs full f16 | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        d = (r["ppl"] / base["ppl"] - 1) * 100
        m = (r["kv_bytes_peak"] / base["kv_bytes_peak"] - 1) * 100
        name = r["attention"]
        if r.get("kv_in_flight"):
            name += f", prompt KV in flight as {r['kv_in_flight']}"
        print(
            f"| {name} | {r['kv_dtype']} | {r['ppl']:.3f} ± {r['ppl_stderr']:.3f} "
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


def steps(paths):
    """Per policy, the median over runs of ms per decode step after the one context."""
    by = {}
    for path in paths:
        r = json.load(open(path))
        for d in r["decode"]:
            by.setdefault(r["attention"], []).append((d["context"], 1000 * d["seconds"] / d["steps"]))
    full = statistics.median(ms for _, ms in by.get("full", [(0, float("nan"))]))
    print("| attention | context | runs | decode ms/step (median) | tokens/s | vs full |")
    print("|---|---|---|---|---|---|")
    for policy, xs in by.items():
        ms = statistics.median(m for _, m in xs)
        print(f"| {policy} | {xs[0][0]} | {len(xs)} | {ms:.1f} | {1000 / ms:.1f} | {ms / full:.2f}x |")


def serve(path):
    """Per policy, the median over runs of each run's p50 TTFT and TPOT, output tokens/s and
    KV bytes moved per request; the window's ratio to full attention's beside it."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    by = {}
    for r in rows:
        s = json.load(open(r["report"]))["runs"][0]["summary"]
        by.setdefault(r["policy"], []).append({
            "ttft": s["ttft_ms"]["p50"],
            "tpot": s["tpot_ms"]["p50"],
            "tput": s["output_throughput"],
            "kv": r["kv_bytes_per_request"],
            "failed": s["failed"],
        })
    full = {k: statistics.median(x[k] for x in by["full"]) for k in ("ttft", "tpot", "tput", "kv")}
    print("| attention | runs | failed | TTFT p50 ms | TPOT p50 ms | output tok/s | KV moved per request | vs full |")
    print("|---|---|---|---|---|---|---|---|")
    for policy, xs in by.items():
        m = {k: statistics.median(x[k] for x in xs) for k in ("ttft", "tpot", "tput", "kv")}
        ratio = "" if policy == "full" else (
            f"TTFT {m['ttft'] / full['ttft']:.2f}x, TPOT {m['tpot'] / full['tpot']:.2f}x, "
            f"KV {m['kv'] / full['kv']:.3f}x"
        )
        failed = sum(x["failed"] for x in xs)
        print(
            f"| {policy} | {len(xs)} | {failed} | {m['ttft']:.0f} | {m['tpot']:.1f} | {m['tput']:.1f} "
            f"| {m['kv'] / 2**20:.2f} MiB | {ratio} |"
        )


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("ppl", "decode", "serve", "steps"):
        sys.exit(__doc__)
    if sys.argv[1] == "steps":
        steps(sys.argv[2:])
    elif sys.argv[1] == "ppl":
        ppl(sys.argv[2])
    elif sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        decode(sys.argv[2:])
