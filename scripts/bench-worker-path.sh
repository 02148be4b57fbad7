#!/usr/bin/env bash
# The workers' KV path, prefill pool to decode pool (`duet bench transfer --end-to-end`),
# beside memcpy in the same run: ROUNDS alternating rounds of shm and tcp with integrity on
# (the default) and off, each point the median of RUNS runs. Writes every report (text and
# JSON) to bench/results/worker-path-DATE/ and prints a table of the ratios to memcpy.
#
# Usage: scripts/bench-worker-path.sh [ROUNDS] [RUNS]   (defaults 3 and 3; release build)
# DUET_BIN: the duet binary to measure (default target/release/duet, built if missing);
# DUET_BENCH_TAG: a suffix for the output directory (to keep two binaries' runs apart).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
rounds="${1:-3}"
runs="${2:-3}"
duet="${DUET_BIN:-$root/target/release/duet}"
if [[ ! -x "$duet" ]]; then
  cargo build --release -p duet
fi
out="bench/results/worker-path-$(date -u +%Y-%m-%d)${DUET_BENCH_TAG:+-$DUET_BENCH_TAG}"
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for backend in shm tcp; do
    for integrity in on off; do
      name="$backend-$integrity-$round"
      "$duet" bench transfer --end-to-end --backend "$backend" --integrity "$integrity" \
        --runs "$runs" --out "$out/$name.json" | tee "$out/$name.txt"
    done
  done
done
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    backend, integrity, _ = os.path.basename(f)[:-5].split("-")
    r = json.load(open(f))
    for p in r["points"]:
        rows.setdefault((backend, integrity, p["bytes"]), []).append(
            (p["gbps"], p["ratio_to_memcpy"], p["copies_per_byte"]))
print(f"{'path':<20} {'MiB':>6} {'GB/s (min-max)':>16} {'x memcpy (min-max)':>20} {'copies':>7}")
for (backend, integrity, size), v in sorted(rows.items()):
    g = [x[0] for x in v]
    q = [x[1] for x in v]
    print(f"{backend + ', integrity ' + integrity:<20} {size / 2**20:>6.0f} "
          f"{min(g):>7.2f}-{max(g):<8.2f} {min(q):>9.2f}-{max(q):<10.2f} {v[0][2]:>7.2f}")
PY
