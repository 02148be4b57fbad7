#!/usr/bin/env bash
# TTFT and time per output token for one long prompt, measured in one run:
#   duet run (one process, no server)          --threads $RUN_THREADS
#   duet up, disaggregated: 1 prefill + 1 decode worker, --threads 1 each (one core each),
#     KV handed over in process (local), over loopback tcp and over shared memory (shm)
#   duet up, colocated: 1 worker, --threads 2
# plus the share of TTFT the KV transfer adds (timings.kv_transfer_seconds / TTFT).
# Env: PROMPT_REPEAT (sentence repeats, ~10 tokens each), MAX_TOKENS, RUNS, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
REPEAT=${PROMPT_REPEAT:-73}
MAX_TOKENS=${MAX_TOKENS:-64}
RUNS=${RUNS:-3}
RUN_THREADS=${RUN_THREADS:-2}
OUT=${OUT:-bench/results/cluster-$(date +%F).json}
BIN=./target/release/duet
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
cargo build --release -p duet >/dev/null
PROMPT=$(python3 -c "print('The quick brown fox jumps over the lazy dog near the river bank. ' * $REPEAT, end='')")

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

measure_up() { # label, extra args...
  local label=$1; shift
  local port; port=$(free_port)
  local log; log=$(mktemp)
  $BIN up --model $MODEL --listen 127.0.0.1:$port --http-listen 127.0.0.1:0 --kv-pool 256MiB --prefix-cache off "$@" >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do grep -q "router listening" "$log" && break; sleep 0.1; done
  # The prompt is sent again and again: without --prefix-cache off every repeat after the
  # first would be a cache hit (docs/prefix-cache.md), not a prefill.
  # Warm-up (first-touch of pools and caches).
  $BIN generate --router http://127.0.0.1:$port --prompt "$PROMPT" --max-tokens 4 --json >/dev/null
  for i in $(seq "$RUNS"); do
    $BIN generate --router http://127.0.0.1:$port --prompt "$PROMPT" --max-tokens "$MAX_TOKENS" --json \
      | python3 -c "import json,sys; d=json.load(sys.stdin); d['label']='$label'; print(json.dumps(d))"
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rm -f "$log"
}

measure_run() {
  for i in $(seq "$RUNS"); do
    $BIN run --model $MODEL --threads "$RUN_THREADS" --prompt "$PROMPT" --max-tokens "$MAX_TOKENS" --json \
      | python3 -c "import json,sys; d=json.load(sys.stdin); d['label']='run'; print(json.dumps(d))"
  done
}

{
  measure_run
  measure_up disaggregated --threads 1 --prefill-workers 1 --decode-workers 1 --local-prefill-max-tokens 0
  measure_up disaggregated-tcp --threads 1 --prefill-workers 1 --decode-workers 1 --local-prefill-max-tokens 0 --kv-transport tcp
  measure_up disaggregated-shm --threads 1 --prefill-workers 1 --decode-workers 1 --local-prefill-max-tokens 0 --kv-transport shm
  measure_up colocated --threads 2 --mode colocated --prefill-workers 0 --decode-workers 1
} | python3 bench/summarize_cluster.py "$OUT"
