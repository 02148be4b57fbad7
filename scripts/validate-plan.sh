#!/usr/bin/env bash
# Checks `duet plan simulate` against `duet bench serve` on this machine (issue 25 item 3):
# profiles the engine (`duet profile`, 1 and 2 threads), then for three layouts
#   disaggregated  duet up, 1 prefill + 1 decode worker, --threads 1 each, every prompt remote
#   conditional    the same with --local-prefill-max-tokens 256 (short prompts on the decode worker)
#   colocated      duet up --mode colocated, 1 worker, --threads 2
# and each rate of RATES, runs the real cluster under `duet bench serve` (a fresh `duet up`
# per rate: every rate starts with cold prefix caches, as every simulated run does) and the
# simulator on the same workload and seed, and writes predicted against measured TTFT and
# TPOT at p50 and p90 with their errors, and the knee (the first rate whose attainment falls
# under 90%), to $OUT/validation.md.
# A profile whose two rounds disagree by more than 15 % at a point is refused by `duet
# profile` (the machine was busy): run again on a quiet machine, or raise
# DUET_PROFILE_AGREE_WITHIN knowingly.
#
#   ./scripts/validate-plan.sh                       # about 25 minutes (measured runs are
#                                                    # kept in $OUT: run again, it only simulates)
#   RATES=0.1,0.3 NUM_PROMPTS=8 LAYOUTS=colocated ./scripts/validate-plan.sh   # a quick look
#
# Run it on an otherwise idle machine: a build beside it moves every measured number.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
die() { echo "validate-plan: $*" >&2; exit 1; }

RATES="${RATES:-0.2,0.4,0.6,0.8,1.0}"
NUM_PROMPTS="${NUM_PROMPTS:-24}"
LAYOUTS="${LAYOUTS:-disaggregated conditional colocated}"
SLO="${SLO:-ttft=5000,tpot=60}"
WORKLOAD=(--dataset uniform --input-len 256 --output-len 64 --range-ratio 0.5 --seed 0)
OUT="${OUT:-$root/bench/results/validate-plan-$(date +%F)}"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || ./scripts/fetch-model.sh
if [ -z "${DUET:-}" ]; then
  cargo build --release -p duet
  DUET="${CARGO_TARGET_DIR:-$root/target}/release/duet"
fi
mkdir -p "$OUT/logs"

pid=""
cleanup() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap cleanup EXIT

# shellcheck source=lib/wait.sh
source "$root/scripts/lib/wait.sh"
duet="$DUET"

# 1. Profiles (engine, links and the router's overhead, as `duet profile` measures them).
for t in 1 2; do
  [ -f "$OUT/profile-t$t.json" ] || "$DUET" profile --model "$model" --threads "$t" --quiet \
    --prefill-tokens 16,64,128,256,384,512 --prefill-cached 0,512 --decode-batch 1,2,4,8,16,32 \
    --decode-context 128,512 --reps 3 --links local --output "$OUT/profile-t$t.json"
done

# 2. Measured and simulated, per layout and rate.
for layout in $LAYOUTS; do
  case "$layout" in
    disaggregated) up=(--threads 1 --local-prefill-max-tokens 0); sim=(--profile "$OUT/profile-t1.json" --local-prefill-max-tokens 0) ;;
    conditional) up=(--threads 1 --local-prefill-max-tokens 256); sim=(--profile "$OUT/profile-t1.json" --local-prefill-max-tokens 256) ;;
    colocated) up=(--threads 2 --mode colocated --prefill-workers 0); sim=(--profile "$OUT/profile-t2.json" --mode colocated) ;;
    *) die "unknown layout $layout" ;;
  esac
  parts=()
  for rate in ${RATES//,/ }; do
    log="$OUT/logs/$layout-$rate.log"
    parts+=("$OUT/$layout-measured-$rate.json")
    # Measured runs are kept: a second invocation only simulates again.
    [ -f "$OUT/$layout-measured-$rate.json" ] && continue
    "$DUET" up --model "$model" "${up[@]}" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$log" 2>&1 &
    pid=$!
    grpc=$(wait_line "$log" "router listening on")
    wait_duet "$grpc"
    "$DUET" bench serve --model "$model" --url "$grpc" --label "$layout" "${WORKLOAD[@]}" \
      --request-rate "$rate" --num-prompts "$NUM_PROMPTS" --slo "$SLO" --quiet \
      --output-json "$OUT/$layout-measured-$rate.json" >"$OUT/logs/$layout-measured-$rate.txt"
    cleanup
  done
  python3 "$root/scripts/plan_compare.py" merge "$OUT/$layout-measured.json" "${parts[@]}"
  "$DUET" plan simulate --model "$model" "${sim[@]}" --label "$layout-simulated" "${WORKLOAD[@]}" \
    --rate-sweep "$RATES" --num-prompts "$NUM_PROMPTS" --slo "$SLO" \
    --output-json "$OUT/$layout-simulated.json" >"$OUT/logs/$layout-simulated.txt" 2>&1
done

# 3. The table.
python3 "$root/scripts/plan_compare.py" table "$OUT" $LAYOUTS | tee "$OUT/validation.md"
