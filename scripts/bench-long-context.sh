#!/usr/bin/env bash
# Quality and memory of duet's KV policies on long text: perplexity over the bench corpus
# (`duet eval perplexity`, llama.cpp's windows) under full attention (f32 and f16 KV) and
# local windows with sinks (StreamingLLM), with each policy's peak KV bytes per sequence.
# Then decode step time against context (`duet bench engine`, batch 1, one thread): full
# attention up to the model's context, a window of 512 with 4 sinks well past it. Prints
# markdown tables; the raw JSON goes to OUT (default bench/results/long-context).
#
#   ./scripts/bench-long-context.sh
#   CTX=8192 CHUNKS=1 PARTS=ppl ./scripts/bench-long-context.sh
#   POLICIES="window=512,sinks=4" PARTS=ppl ./scripts/bench-long-context.sh
#   PARTS=decode FULL_CONTEXTS=1024,4096 WINDOW_CONTEXTS=1024,32768 ./scripts/bench-long-context.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
CTX="${CTX:-2048}"
CHUNKS="${CHUNKS:-4}"
THREADS="${THREADS:-2}"
FILE="${FILE:-$root/bench/data/persuasion-vol1.txt}"
POLICIES="${POLICIES:-window=1024,sinks=4 window=512,sinks=4 window=512,sinks=0 window=256,sinks=4}"
OUT="${OUT:-$root/bench/results/long-context}"
PARTS="${PARTS:-ppl decode}"
FULL_CONTEXTS="${FULL_CONTEXTS:-1024,2048,4096,8000}"
WINDOW_CONTEXTS="${WINDOW_CONTEXTS:-1024,4096,8000,16384,32768}"
WINDOW="${WINDOW:-window=512,sinks=4}"
STEPS="${STEPS:-64}"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || ./scripts/fetch-model.sh
if [ -z "${DUET:-}" ]; then
  cargo build --release -p duet
  DUET="${CARGO_TARGET_DIR:-$root/target}/release/duet"
fi
mkdir -p "$OUT"

# One perplexity run, one JSON line (with its KV dtype and wall time) appended to $2.
ppl_run() { # attention kv-dtype jsonl
  local start json
  start=$(date +%s.%N)
  json=$("$DUET" eval perplexity --model "$model" --file "$FILE" --ctx "$CTX" \
    --chunks "$CHUNKS" --threads "$THREADS" --attention "$1" --kv-dtype "$2" --json)
  python3 -c '
import json, sys, time
r = json.loads(sys.argv[1])
r["kv_dtype"] = sys.argv[2]
r["seconds"] = round(time.time() - float(sys.argv[3]), 1)
print(json.dumps(r))' "$json" "$2" "$start" >>"$3"
}

ppl() {
  local jsonl="$OUT/ppl-ctx$CTX.jsonl"
  : >"$jsonl"
  ppl_run full f32 "$jsonl"
  ppl_run full f16 "$jsonl"
  for p in $POLICIES; do ppl_run "$p" f16 "$jsonl"; done
  python3 "$root/scripts/long_context_table.py" ppl "$jsonl"
}

decode() {
  local full="$OUT/decode-full.json" win="$OUT/decode-window.json"
  for pair in "full:$FULL_CONTEXTS:$full" "$WINDOW:$WINDOW_CONTEXTS:$win"; do
    IFS=: read -r attention contexts json <<<"$pair"
    "$DUET" bench engine --model "$model" --threads 1 --prefill 16 --batch 1 \
      --context "$contexts" --steps "$STEPS" --attention "$attention" \
      --kv-pool-bytes 1048576 --json "$json" 2>/dev/null
  done
  python3 "$root/scripts/long_context_table.py" decode "$full" "$win"
}

for part in $PARTS; do "$part"; done
