#!/usr/bin/env bash
# Quality and memory of duet's KV policies on long text: perplexity over the bench corpus
# (`duet eval perplexity`, llama.cpp's windows) under full attention (f32 and f16 KV) and
# local windows with sinks (StreamingLLM), with each policy's peak KV bytes per sequence.
# Then decode step time against context (`duet bench engine`, batch 1, one thread): full
# attention up to the model's context, a window of 512 with 4 sinks well past it. Then the
# same served workload through `duet up` (every prompt prefilled on the prefill worker, its
# KV moved to the decode worker) with full attention and with a window per request
# (`attention` in the OpenAI body), alternating, RUNS times: TTFT, TPOT, KV bytes moved and
# the decode pool's peak per request. Prints markdown tables; the raw JSON goes to OUT
# (default bench/results/long-context).
#
#   ./scripts/bench-long-context.sh
#   CTX=8192 CHUNKS=1 PARTS=ppl ./scripts/bench-long-context.sh
#   POLICIES="window=512,sinks=4" PARTS=ppl ./scripts/bench-long-context.sh
#   PARTS=decode FULL_CONTEXTS=1024,4096 WINDOW_CONTEXTS=1024,32768 ./scripts/bench-long-context.sh
#   PARTS=serve SERVE_INPUT=2000 SERVE_OUTPUT=64 RUNS=3 ./scripts/bench-long-context.sh
#   PARTS=agree AGREE_PROMPTS=8 AGREE_TOKENS=1500 ./scripts/bench-long-context.sh
#   PARTS=steps STEP_CONTEXT=4096 RUNS=3 ./scripts/bench-long-context.sh
#   PARTS=inflight ./scripts/bench-long-context.sh
#
# `agree`: greedy agreement with full attention of each policy in AGREE_POLICIES (windows
# and SnapKV budgets) on long prompts (corpus passages and a question about their start),
# through `duet run --attention`, with the KV each keeps after its prompt.
# `steps`: decode step time of every policy in STEP_POLICIES after a STEP_CONTEXT-token
# prompt (`duet bench engine`, batch 1, one thread), alternating, RUNS times; medians.
# `inflight`: what int8 KV in flight (`--kv-compression int8`) costs: perplexity with each
# window's prompt KV put through kv-transfer's codec (`--kv-in-flight none|int8`), and
# greedy agreement of a `duet up --kv-compression int8` cluster (every prompt prefilled
# remotely, its KV over tcp: the in-process `local` transport hands buffers over and never
# encodes) with `duet run` on the long prompts and the reference prompts.
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
SERVE_INPUT="${SERVE_INPUT:-2000}"
SERVE_OUTPUT="${SERVE_OUTPUT:-64}"
SERVE_PROMPTS="${SERVE_PROMPTS:-8}"
RUNS="${RUNS:-3}"
FULL_KV="${FULL_KV-f32 f16}"
AGREE_PROMPTS="${AGREE_PROMPTS:-8}"
AGREE_TOKENS="${AGREE_TOKENS:-1500}"
AGREE_POLICIES="${AGREE_POLICIES:-window=1024,sinks=4 window=512,sinks=4 snapkv=1024 snapkv=512}"
STEP_CONTEXT="${STEP_CONTEXT:-4096}"
STEP_POLICIES="${STEP_POLICIES:-full window=1024,sinks=4 window=512,sinks=4 snapkv=1024 snapkv=512}"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || ./scripts/fetch-model.sh
if [ -z "${DUET:-}" ]; then
  cargo build --release -p duet
  DUET="${CARGO_TARGET_DIR:-$root/target}/release/duet"
fi
mkdir -p "$OUT"

# One perplexity run, one JSON line (with its KV dtype and wall time) appended to $3;
# further arguments go to `duet eval perplexity`.
ppl_run() { # attention kv-dtype jsonl [args...]
  local start json
  start=$(date +%s.%N)
  json=$("$DUET" eval perplexity --model "$model" --file "$FILE" --ctx "$CTX" \
    --chunks "$CHUNKS" --threads "$THREADS" --attention "$1" --kv-dtype "$2" --json "${@:4}")
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
  for dtype in $FULL_KV; do ppl_run full "$dtype" "$jsonl"; done
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

# The first address `duet up` logs after `$2` in log file $1.
logged_url() {
  local i
  for i in $(seq 1 600); do
    if grep -q "$2" "$1"; then
      grep -o "$2 [^ ]*" "$1" | head -1 | awk '{print $NF}'
      return
    fi
    sleep 0.2
  done
  echo "no '$2' in $1" >&2
  exit 1
}

# Sum of metric $2's samples on the exposition at $1.
scrape() {
  curl -s "$1" | awk -v m="$2" '$1 ~ "^"m"({|$)" {s += $NF} END {printf "%.0f\n", s}'
}

serve() {
  local log="$OUT/serve-up.log" url
  "$DUET" up --model "$model" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
    --local-prefill-max-tokens 0 --kv-pool 256MiB --prefix-cache off >"$log" 2>&1 &
  up_pid=$!
  trap 'kill "${up_pid:-}" 2>/dev/null || true' EXIT
  url=$(logged_url "$log" "http listening on")
  local jsonl="$OUT/serve.jsonl"
  : >"$jsonl"
  for run in $(seq 1 "$RUNS"); do
    for policy in full "$WINDOW"; do
      local json="$OUT/serve-$policy-$run.json" before after
      before=$(scrape "$url/metrics" duet_kv_transfer_bytes_total)
      "$DUET" bench serve --model "$model" --url "$url" --backend openai --prompt-format tokens \
        --ignore-eos-param ignore-eos --dataset uniform --range-ratio 0 \
        --input-len "$SERVE_INPUT" --output-len "$SERVE_OUTPUT" --num-prompts "$SERVE_PROMPTS" \
        --max-concurrency 2 --seed "$run" --label "$policy" \
        --extra-body "{\"attention\": \"$policy\"}" --output-json "$json" >/dev/null
      after=$(scrape "$url/metrics" duet_kv_transfer_bytes_total)
      python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"policy": sys.argv[2], "run": int(sys.argv[3]), "report": sys.argv[1],
                  "kv_bytes_per_request": (int(sys.argv[5]) - int(sys.argv[4])) / int(sys.argv[6])}))
' "$json" "$policy" "$run" "$before" "$after" "$SERVE_PROMPTS" >>"$jsonl"
    done
  done
  kill "$up_pid" 2>/dev/null || true
  python3 "$root/scripts/long_context_table.py" serve "$jsonl"
}

steps() {
  local dir="$OUT/steps-$STEP_CONTEXT" run p
  mkdir -p "$dir"
  for run in $(seq 1 "$RUNS"); do
    for p in $STEP_POLICIES; do
      "$DUET" bench engine --model "$model" --threads 1 --prefill 16 --batch 1 \
        --context "$STEP_CONTEXT" --steps "$STEPS" --attention "$p" \
        --kv-pool-bytes 1048576 --json "$dir/$p-$run.json" 2>/dev/null
    done
  done
  python3 "$root/scripts/long_context_table.py" steps "$dir"/*.json
}

inflight() {
  local jsonl="$OUT/inflight-ppl-ctx$CTX.jsonl" log="$OUT/inflight-up.log" router
  : >"$jsonl"
  for c in none int8; do ppl_run full f16 "$jsonl" --kv-in-flight "$c"; done
  python3 "$root/scripts/long_context_table.py" ppl "$jsonl"
  "$DUET" up --model "$model" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
    --local-prefill-max-tokens 0 --kv-transport tcp --kv-compression int8 --prefix-cache off \
    >"$log" 2>&1 &
  up_pid=$!
  trap 'kill "${up_pid:-}" 2>/dev/null || true' EXIT
  router=$(logged_url "$log" "router listening on")
  python3 "$root/scripts/long_context_agree.py" "$DUET" "$model" "$FILE" \
    "$OUT/inflight-agree.jsonl" --prompts "$AGREE_PROMPTS" --tokens "$AGREE_TOKENS" \
    --policies "int8@$router"
  python3 "$root/scripts/long_context_agree.py" "$DUET" "$model" "$FILE" \
    "$OUT/inflight-agree-reference.jsonl" --policies "int8@$router" \
    --reference "$root/tests/data/smollm2-q4_1-greedy.jsonl"
  kill "$up_pid" 2>/dev/null || true
}

agree() {
  python3 "$root/scripts/long_context_agree.py" "$DUET" "$model" "$FILE" "$OUT/agree.jsonl" \
    --prompts "$AGREE_PROMPTS" --tokens "$AGREE_TOKENS" --policies "$AGREE_POLICIES"
  # llama.cpp's 10 reference prompts, as many tokens as its greedy runs.
  python3 "$root/scripts/long_context_agree.py" "$DUET" "$model" "$FILE" \
    "$OUT/agree-reference.jsonl" --policies "$AGREE_POLICIES" \
    --reference "$root/tests/data/smollm2-q4_1-greedy.jsonl"
}

for part in $PARTS; do "$part"; done
