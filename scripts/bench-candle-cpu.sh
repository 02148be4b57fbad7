#!/usr/bin/env bash
# The candle engine on candle's CPU device beside the native engine, same binary, same
# prompt, same run (alternating, median of RUNS): prefill tok/s and decode ms/token from
# `duet run --json`. Run by hand (not in CI) on an otherwise idle machine:
#
#   ./scripts/bench-candle-cpu.sh              # 512-token prompt, 128 tokens, 3 runs
#   PROMPT_WORDS=300 RUNS=5 ./scripts/bench-candle-cpu.sh
#
# candle's CPU device sizes its thread pool from RAYON_NUM_THREADS; the native engine takes
# --threads. Both get THREADS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${RUNS:-3}"
THREADS="${THREADS:-2}"
TOKENS="${TOKENS:-128}"
PROMPT_WORDS="${PROMPT_WORDS:-380}"
MODEL="${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
./scripts/fetch-model.sh >/dev/null
cargo build --release -p duet >/dev/null 2>&1
prompt="$(tr -s '[:space:]' ' ' < bench/data/persuasion-vol1.txt | cut -d' ' -f1-"$PROMPT_WORDS")"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for r in $(seq "$RUNS"); do
  for engine in native candle; do
    RAYON_NUM_THREADS="$THREADS" ./target/release/duet run --model "$MODEL" --engine "$engine" \
      --threads "$THREADS" --prompt "$prompt" --max-tokens "$TOKENS" --json \
      | python3 -c '
import json, sys
o = json.load(sys.stdin)
t = o["timings"]
print(sys.argv[1], len(o["prompt_ids"]), len(o["ids"]),
      len(o["prompt_ids"]) / t["prefill_ms"] * 1000, t["decode_ms_per_token"])' "$engine" >> "$out"
  done
done
python3 - "$out" "$THREADS" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for e, p, n, pre, dec in rows:
    by.setdefault(e, []).append((int(p), int(n), float(pre), float(dec)))
med = {e: (statistics.median(r[2] for r in v), statistics.median(r[3] for r in v)) for e, v in by.items()}
p, n = by["native"][0][0], by["native"][0][1]
print(f"{p}-token prompt, {n} generated, {sys.argv[2]} threads, median of {len(by['native'])} alternating runs")
print(f"{'engine':8} {'prefill tok/s':>14} {'decode ms/token':>16}")
for e in ("native", "candle"):
    print(f"{e:8} {med[e][0]:14.1f} {med[e][1]:16.2f}")
print(f"candle/native: prefill {med['candle'][0] / med['native'][0]:.2f}x, "
      f"decode speed {med['native'][1] / med['candle'][1]:.2f}x")
PY
