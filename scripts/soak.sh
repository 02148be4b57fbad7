#!/usr/bin/env bash
# Soak: `duet up` under steady load for a long time (not CI; by hand, on an idle machine).
#
#   scripts/soak.sh                     30 minutes at 70 % of the capacity measured first
#   DURATION=600 scripts/soak.sh        a shorter run
#
# Steps:
#   1. builds the release binary, starts `duet up` (1 prefill + 1 decode worker, one process)
#      on free ports;
#   2. capacity: a closed loop of CONCURRENCY clients for CAPACITY_PROMPTS requests ->
#      completed requests per second;
#   3. the soak: Poisson arrivals at LOAD x capacity for DURATION seconds (`duet bench serve`),
#      while the process's resident memory (VmRSS) is sampled every 5 s;
#   4. after the load: every KV block free (duet_decode_kv_blocks_used = 0), nothing in
#      flight or queued (router, prefill, decode gauges).
# Pass: no failed request; RSS at the end at most 5 % above RSS at the end of the warm-up
# (WARMUP_S seconds into the soak); all blocks free. Prints a summary and writes
# OUT/summary.json, OUT/rss.csv, OUT/soak.json (every request) and OUT/capacity.json.
#
# Environment [defaults]: DURATION [1800], LOAD [0.7], WARMUP_S [300], CONCURRENCY [8],
# CAPACITY_PROMPTS [40], WORKLOAD ["--dataset fixed --input-len 128 --output-len 64"],
# OUT [bench/results/soak-<date>]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
DURATION="${DURATION:-1800}"
LOAD="${LOAD:-0.7}"
WARMUP_S="${WARMUP_S:-300}"
CONCURRENCY="${CONCURRENCY:-8}"
CAPACITY_PROMPTS="${CAPACITY_PROMPTS:-40}"
read -r -a WORKLOAD <<<"${WORKLOAD:---dataset fixed --input-len 128 --output-len 64}"
OUT="${OUT:-$root/bench/results/soak-$(date +%F)}"
say() { echo "soak: $*" >&2; }
[ "$DURATION" -gt "$WARMUP_S" ] || { say "DURATION ($DURATION) must exceed WARMUP_S ($WARMUP_S)"; exit 2; }
mkdir -p "$OUT"

./scripts/fetch-model.sh >/dev/null
cargo build --release -p duet
duet="${CARGO_TARGET_DIR:-$root/target}/release/duet"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"

"$duet" up --model "$model" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$OUT/up.log" 2>&1 &
up=$!
sampler=""
cleanup() {
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null || true
  kill "$up" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 600); do
  grep -q "http listening on" "$OUT/up.log" && break
  kill -0 "$up" 2>/dev/null || { cat "$OUT/up.log" >&2; exit 1; }
  sleep 0.1
done
url="$(grep -o 'router listening on [^ ]*' "$OUT/up.log" | awk '{print $4}')"
http="$(grep -o 'http listening on [^ ]*' "$OUT/up.log" | awk '{print $4}')"
say "duet up (pid $up): $url, $http"

bench=("$duet" bench serve --backend duet --url "$url" --model "$model" "${WORKLOAD[@]}" --quiet)
"${bench[@]}" --max-concurrency "$CONCURRENCY" --num-prompts "$CAPACITY_PROMPTS" --warmup 2 \
  --output-json "$OUT/capacity.json" >"$OUT/capacity.txt"
capacity="$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['runs'][0]['summary']['request_throughput'])" "$OUT/capacity.json")"
rate="$(python3 -c "print(round(float('$capacity') * float('$LOAD'), 4))")"
say "capacity $capacity req/s with $CONCURRENCY clients; soaking at $rate req/s for ${DURATION}s"

echo "t_s,rss_kib" >"$OUT/rss.csv"
(
  t0=$(date +%s)
  while kill -0 "$up" 2>/dev/null; do
    echo "$(( $(date +%s) - t0 )),$(awk '/^VmRSS/ {print $2}' "/proc/$up/status")" >>"$OUT/rss.csv"
    sleep 5
  done
) &
sampler=$!
"${bench[@]}" --request-rate "$rate" --duration "$DURATION" --seed 1 \
  --output-json "$OUT/soak.json" >"$OUT/soak.txt"
kill "$sampler" 2>/dev/null || true
sampler=""

# After the load: everything must drain to zero.
for _ in $(seq 100); do
  curl -sf --max-time 5 "$http/metrics" >"$OUT/metrics-after.txt" || { sleep 0.1; continue; }
  python3 - "$OUT/metrics-after.txt" <<'PY' && break
import re, sys
text = open(sys.argv[1]).read()
def total(name):
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
busy = {n: total(n) for n in ("duet_decode_kv_blocks_used", "duet_router_requests_in_flight",
        "duet_router_requests_queued", "duet_decode_running_sequences",
        "duet_decode_waiting_sequences", "duet_prefill_queue_depth")}
sys.exit(0 if all(v == 0 for v in busy.values()) else 1)
PY
  sleep 0.1
done

python3 - "$OUT" "$WARMUP_S" "$capacity" "$rate" <<'PY'
import csv, json, re, sys
out, warm, capacity, rate = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
s = json.load(open(f"{out}/soak.json"))["runs"][0]["summary"]
rows = [(float(r["t_s"]), int(r["rss_kib"])) for r in csv.DictReader(open(f"{out}/rss.csv")) if r["rss_kib"]]
text = open(f"{out}/metrics-after.txt").read()
def total(name):
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
after = {n: total(n) for n in ("duet_decode_kv_blocks_used", "duet_decode_kv_blocks_capacity",
         "duet_router_requests_in_flight", "duet_router_requests_queued",
         "duet_decode_running_sequences", "duet_decode_waiting_sequences", "duet_prefill_queue_depth")}
# RSS at the end of the warm-up (the first sample at or after it) and at the end of the load.
load_end = min(rows[-1][0], s["duration_s"] + rows[0][0] if rows else 0)
at_warm = next(v for t, v in rows if t >= warm)
at_end = [v for t, v in rows if t <= load_end + 5][-1]
peak_after = max(v for t, v in rows if t >= warm)
growth = (at_end - at_warm) / at_warm
summary = {
    "capacity_rps": capacity, "offered_rps": rate, "duration_s": s["duration_s"],
    "requests": s["requests"], "completed": s["completed"], "failed": s["failed"], "errors": s["errors"],
    "request_throughput": s["request_throughput"], "ttft_p90_ms": s["ttft_ms"]["p90"],
    "tpot_p90_ms": s["tpot_ms"]["p90"],
    "rss_kib": {"first": rows[0][1], "after_warmup": at_warm, "end": at_end, "peak_after_warmup": peak_after},
    "rss_growth_after_warmup": growth, "after_load": after,
    "pass": {"no_errors": s["failed"] == 0, "rss_growth_below_5pct": growth < 0.05,
             "all_blocks_free": after["duet_decode_kv_blocks_used"] == 0 and after["duet_router_requests_in_flight"] == 0},
}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
sys.exit(0 if all(summary["pass"].values()) else 1)
PY
