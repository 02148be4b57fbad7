#!/usr/bin/env bash
# Matmul speed of the quantized formats (K-quants, Q5_0): duet's kernels (`duet bench matmul`) beside llama.cpp's CPU backend
# on the same weight matrix and activation rows (bench/llama_cpp_matmul_speed.py: a one-op
# ggml graph of llama-cpp-python 0.3.36's libggml-cpu), 1 thread, ROUNDS alternating rounds
# of each, medians. Also prints duet's time with the matrix expanded to f32 (what the
# engine did with K-quants before it had kernels for them).
#
# Env: TENSORS (default: Gemma 3 270M's blk.0.attn_output (Q4_K), blk.0.ffn_down (Q6_K) and
#      blk.0.attn_q (Q5_0)),
#      ROWS (1,4,16,128), ROUNDS (3), MODEL (models/gemma-3-270m-q4_k_m.gguf).
# Needs .venv/llama (llama-cpp-python 0.3.36 + gguf: scripts/check-kquant-llama.sh installs it).
# Results: bench/results/kquant/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$root/.venv/llama/bin/python"
model="${MODEL:-$root/models/gemma-3-270m-q4_k_m.gguf}"
rows="${ROWS:-1,4,16,128}"
rounds="${ROUNDS:-3}"
out="$root/bench/results/kquant"
"$py" -c 'import llama_cpp, gguf' || { echo "bench-kquant: $py lacks llama_cpp/gguf (run scripts/check-kquant-llama.sh once)" >&2; exit 1; }
./scripts/fetch-gemma.sh >&2
cargo build --release -p duet >&2
duet="${CARGO_TARGET_DIR:-$root/target}/release/duet"
mkdir -p "$out"
rm -f "$out"/*.json
for t in ${TENSORS:-blk.0.attn_output.weight blk.0.ffn_down.weight blk.0.attn_q.weight}; do
  for r in $(seq "$rounds"); do
    taskset -c 0 "$duet" bench matmul --model "$model" --tensor "$t" --rows "$rows" --threads 1 \
      --repeat 9 --json "$out/duet-$t-$r.json" >/dev/null
    taskset -c 0 "$py" bench/llama_cpp_matmul_speed.py --model "$model" --tensor "$t" --rows "$rows" \
      --threads 1 --repeat 9 2>/dev/null > "$out/llama-$t-$r.json"
  done
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys, collections
out = sys.argv[1]
acc = collections.defaultdict(lambda: collections.defaultdict(list))
meta = {}
for f in glob.glob(f"{out}/duet-*.json"):
    d = json.load(open(f)); meta[d["tensor"]] = (d["format"], d["shape"])
    for p in d["points"]:
        acc[(d["tensor"], p["rows"])]["duet"].append(p["native_ms"])
        acc[(d["tensor"], p["rows"])]["f32"].append(p["expanded_f32_ms"])
for f in glob.glob(f"{out}/llama-*.json"):
    d = json.load(open(f))
    for p in d["points"]:
        acc[(d["tensor"], p["rows"])]["llama"].append(p["llama_cpp_ms"])
lines = ["| tensor | type | shape | rows | duet ms | llama.cpp ms | duet / llama.cpp | duet f32-expanded ms |",
         "|---|---|---|---:|---:|---:|---:|---:|"]
for (t, n) in sorted(acc):
    m = {k: statistics.median(v) for k, v in acc[(t, n)].items()}
    fmt, shape = meta[t]
    lines.append(f"| {t} | {fmt} | {shape[0]}x{shape[1]} | {n} | {m['duet']:.3f} | {m['llama']:.3f} | "
                 f"{m['duet'] / m['llama']:.2f}x | {m['f32']:.3f} |")
table = "\n".join(lines)
open(f"{out}/summary.md", "w").write(table + "\n")
print(table)
PY
