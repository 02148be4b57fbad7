#!/usr/bin/env bash
# Prefix-cache benchmark: two workloads whose prompts repeat prefixes, each run against
# `duet up` (2 prefill workers + 1 decode worker, one process) in three configurations, all
# in one invocation on the same machine. Run by hand (not in CI); see docs/benchmarks.md.
#
#   off        --prefix-cache off --kv-routing off   (every prompt computed whole)
#   cache      --prefix-cache on  --kv-routing off   (workers cache; the router routes on
#                                                     load alone)
#   cache+kv   --prefix-cache on  --kv-routing on    (the default: KV-aware routing)
#
# Workloads (duet bench serve, greedy, exact output lengths):
#   shared-system  SGLang's generated-shared-prefix shape: NUM_PREFIXES system prompts of
#                  SYSTEM_LEN tokens, each request one of them plus a question of
#                  QUESTION_LEN tokens
#   multi-turn     chat conversations of TURNS turns: each turn's prompt is the last one,
#                  its reply and a new user message (TURN_LEN tokens); a system prompt of
#                  SYSTEM_LEN tokens shared by every conversation
#
# For each run: TTFT (mean, p50, p90), the prompt tokens the workers served from their
# caches and those they computed (the bench's usage totals, cross-checked with the prefill
# workers' duet_prefill_prompt_tokens_total), and the ratios against `off`.
#
# Environment (defaults in brackets):
#   CONFIGS       ["off cache cache+kv"]      WORKLOADS  ["shared-system multi-turn"]
#   NUM_PROMPTS   requests per run [48]       CONCURRENCY  requests (or conversations) in
#                                                          flight [4]
#   SYSTEM_LEN [384]  QUESTION_LEN [128]  NUM_PREFIXES [4]  OUTPUT_LEN [16]
#   TURNS [4]  TURN_LEN [48]  KV_POOL  every worker's KV pool [512MiB]
#   OUT           results directory [bench/results/prefix-<date>]
#   SMOKE=1       a tiny run to check the script (short prompts, 8 requests)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { echo "bench-prefix: $*" >&2; }
die() { say "$*"; exit 1; }

CONFIGS="${CONFIGS:-off cache cache+kv}"
WORKLOADS="${WORKLOADS:-shared-system multi-turn}"
NUM_PROMPTS="${NUM_PROMPTS:-48}"
CONCURRENCY="${CONCURRENCY:-4}"
SYSTEM_LEN="${SYSTEM_LEN:-384}"
QUESTION_LEN="${QUESTION_LEN:-128}"
NUM_PREFIXES="${NUM_PREFIXES:-4}"
OUTPUT_LEN="${OUTPUT_LEN:-16}"
TURNS="${TURNS:-4}"
TURN_LEN="${TURN_LEN:-48}"
KV_POOL="${KV_POOL:-512MiB}"
if [ "${SMOKE:-0}" = 1 ]; then
  NUM_PROMPTS=8 SYSTEM_LEN=48 QUESTION_LEN=24 TURN_LEN=16 OUTPUT_LEN=4 TURNS=2
  OUT="${OUT:-$(mktemp -d /tmp/duet-bench-prefix-smoke.XXXXXX)}"
fi
OUT="${OUT:-$root/bench/results/prefix-$(date +%F)}"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$OUT/logs"

./scripts/fetch-model.sh
cargo build --release -p duet
duet="${CARGO_TARGET_DIR:-$root/target}/release/duet"
[ -x "$duet" ] || die "$duet not found after cargo build"

up_pid=""
stop_up() {
  if [ -n "$up_pid" ]; then kill "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true; fi
  up_pid=""
}
trap stop_up EXIT

# shellcheck source=lib/wait.sh
source "$root/scripts/lib/wait.sh"

# Sum of a counter over every series on a /metrics page.
counter() { curl -sf "$1" | awk -v n="$2" 'index($1, n "{") == 1 || $1 == n {s += $2} END {printf "%.0f", s}'; }

workload_flags() {
  case "$1" in
    shared-system)
      echo "--dataset fixed --input-len $((SYSTEM_LEN + QUESTION_LEN)) --output-len $OUTPUT_LEN \
        --shared-prefix-len $SYSTEM_LEN --num-prefixes $NUM_PREFIXES" ;;
    multi-turn)
      echo "--dataset fixed --input-len $((SYSTEM_LEN + TURN_LEN)) --output-len $OUTPUT_LEN \
        --shared-prefix-len $SYSTEM_LEN --turns $TURNS --max-input-len 4096" ;;
    *) die "unknown workload $1" ;;
  esac
}

config_flags() {
  case "$1" in
    off) echo "--prefix-cache off --kv-routing off" ;;
    cache) echo "--prefix-cache on --kv-routing off" ;;
    cache+kv) echo "--prefix-cache on --kv-routing on" ;;
    *) die "unknown configuration $1" ;;
  esac
}

for w in $WORKLOADS; do
  for c in $CONFIGS; do
    log="$OUT/logs/$w-$c.log"
    # shellcheck disable=SC2046
    "$duet" up --model "$model" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
      --prefill-workers 2 --decode-workers 1 --kv-pool "$KV_POOL" $(config_flags "$c") >"$log" 2>&1 &
    up_pid=$!
    url=$(wait_line "$log" "router listening on")
    metrics=$(wait_line "$log" "metrics on")/metrics
    before=$(counter "$metrics" duet_prefill_prompt_tokens_total)
    say "$w / $c: duet up at $url"
    # shellcheck disable=SC2046
    "$duet" bench serve --url "$url" --model "$model" --label "$w $c" --quiet \
      $(workload_flags "$w") --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" \
      --warmup 0 --seed 1 --output-json "$OUT/$w-$c.json" | tee "$OUT/logs/$w-$c.table"
    after=$(counter "$metrics" duet_prefill_prompt_tokens_total)
    echo "{\"prefill_worker_tokens_computed\": $((after - before))}" >"$OUT/$w-$c.workers.json"
    stop_up
  done
done

python3 - "$OUT" "$WORKLOADS" "$CONFIGS" <<'EOF'
import json, os, sys
out, workloads, configs = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
rows = ["| workload | configuration | requests | TTFT mean / p50 / p90 ms | TTFT vs off | "
        "cached / prompt tokens | computed tokens | computed vs off | prefill workers computed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
for w in workloads:
    base = None
    for c in configs:
        p = os.path.join(out, f"{w}-{c}.json")
        if not os.path.exists(p):
            continue
        s = json.load(open(p))["runs"][0]["summary"]
        workers = json.load(open(os.path.join(out, f"{w}-{c}.workers.json")))
        t = s["ttft_ms"]
        computed = s["prompt_tokens"] - s["cached_tokens"]
        if base is None:
            base = (t["mean"], computed)
        rows.append(
            f"| {w} | {c} | {s['completed']}/{s['requests']} | {t['mean']:.0f} / {t['p50']:.0f} / "
            f"{t['p90']:.0f} | {t['mean'] / base[0]:.2f}x | {s['cached_tokens']} / "
            f"{s['prompt_tokens']} | {computed} | {computed / max(base[1], 1):.2f}x | "
            f"{workers['prefill_worker_tokens_computed']} |")
table = "\n".join(rows)
open(os.path.join(out, "summary.md"), "w").write(table + "\n")
print(table)
EOF
say "results in $OUT"
