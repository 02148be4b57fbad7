#!/usr/bin/env bash
# How fast `duet plan simulate` runs: simulated seconds per wall-clock second on one core,
# for clusters of 10, 100 and 1,000 workers (half prefill, half decode) under the same load
# per worker (RATE_PER_WORKER requests/s, about NUM_PER_WORKER requests each), on the hand
# GPU profile (plan/profiles/a100-opt13b-distserve.json). Each size runs REPEATS times; the
# table gives the median.
#
#   ./scripts/bench-plan.sh
#   SIZES="10 100" REPEATS=1 ./scripts/bench-plan.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
SIZES="${SIZES:-10 100 1000}"
REPEATS="${REPEATS:-3}"
RATE_PER_WORKER="${RATE_PER_WORKER:-1}"
NUM_PER_WORKER="${NUM_PER_WORKER:-40}"
PROFILE="${PROFILE:-$root/plan/profiles/a100-opt13b-distserve.json}"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || ./scripts/fetch-model.sh
if [ -z "${DUET:-}" ]; then
  cargo build --release -p duet
  DUET="${CARGO_TARGET_DIR:-$root/target}/release/duet"
fi
echo "| workers | requests | rate req/s | simulated s | wall s | x real time | events |"
echo "|---|---|---|---|---|---|---|"
for n in $SIZES; do
  half=$((n / 2))
  rate=$(python3 -c "print($n * $RATE_PER_WORKER)")
  num=$((n * NUM_PER_WORKER))
  lines=()
  for _ in $(seq "$REPEATS"); do
    line=$(taskset -c 0 "$DUET" plan simulate --profile "$PROFILE" --model "$model" \
      --prefill-workers "$half" --decode-workers "$half" --kv-link ib-hdr \
      --dataset uniform --input-len 512 --output-len 64 --request-rate "$rate" \
      --num-prompts "$num" 2>&1 >/dev/null | grep '^simulated')
    lines+=("$line")
  done
  printf '%s\n' "${lines[@]}" | python3 -c "
import re, sys, statistics
rows = [re.match(r'simulated ([\d.]+) s of (\d+) requests in ([\d.]+) s \((\d+)x real time, (\d+) events\)', l).groups() for l in sys.stdin]
rows.sort(key=lambda r: int(r[3]))
sim, req, wall, x, ev = rows[len(rows) // 2]
print(f'| $n | {req} | $rate | {sim} | {wall} | {x} | {ev} |')
"
done
