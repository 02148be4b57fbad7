#!/usr/bin/env bash
# Engine throughput: duet beside llama.cpp on the same GGUF and thread count.
# Run by hand (not in CI) on an otherwise idle machine:
#
#   ./scripts/bench-engine.sh            # threads 1 and 2
#   THREADS="1" STEPS=16 ./scripts/bench-engine.sh
#
# Fetches the model, builds duet (release), installs llama-cpp-python into
# .venv/llama (first time: compiles llama.cpp, 4-6 minutes), then for each
# thread count runs `duet bench engine` and bench/llama_cpp_engine.py pinned to
# the same cores, writes JSON into bench/results/ and prints a comparison
# (also written to bench/results/engine-<date>.md).
#
# Environment:
#   MODEL      the GGUF to run (default the SmolLM2 model; e.g.
#              models/gemma-3-270m-q4_k_m.gguf, fetched by make model)
#   THREADS    thread counts to run (default "1 2")
#   STEPS      timed decode steps per batch size, both engines (default 32)
#   BATCH      decode batch sizes, both engines (default 1,4,16,64)
#   PREFILL    prefill prompt lengths, both engines (default 128,512,1024)
#   DUET_ARGS  extra flags for `duet bench engine` (e.g. "--weights quantized")
#   LLAMA_PY   a python with llama_cpp and numpy to use instead of .venv/llama
#   CARGO      cargo binary (default cargo)
#   RESULTS    where JSON and the markdown go (default bench/results)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

THREADS="${THREADS:-1 2}"
STEPS="${STEPS:-32}"
BATCH="${BATCH:-1,4,16,64}"
PREFILL="${PREFILL:-128,512,1024}"
DUET_ARGS="${DUET_ARGS:-}"
CARGO="${CARGO:-cargo}"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
model="${MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
results="${RESULTS:-$root/bench/results}"
venv="$root/.venv/llama"

say() { echo "bench-engine: $*" >&2; }
die() { say "$*"; exit 1; }

# Warn when other work is using the CPUs: both engines lose throughput, and
# llama.cpp's OpenMP threads collapse (10x and worse) when one of their cores
# is shared. Linux /proc/stat, 2-second sample.
warn_if_busy() {
  [ -r /proc/stat ] || return 0
  local a b c d e f g t1 i1 t2 i2 busy
  read -r _ a b c d e f g _ </proc/stat; t1=$((a + b + c + d + e + f + g)); i1=$((d + e))
  sleep 2
  read -r _ a b c d e f g _ </proc/stat; t2=$((a + b + c + d + e + f + g)); i2=$((d + e))
  [ "$t2" -gt "$t1" ] || return 0
  busy=$(((t2 - t1 - (i2 - i1)) * 100 / (t2 - t1)))
  if [ "$busy" -ge 10 ]; then
    say "WARNING: the CPUs are ${busy}% busy with other work; numbers will be low and noisy"
  fi
}

# 1. Model and duet.
./scripts/fetch-model.sh
./scripts/fetch-gemma.sh
"$CARGO" build --release -p duet
duet="${CARGO_TARGET_DIR:-$root/target}/release/duet"
[ -x "$duet" ] || die "$duet not found after cargo build"

# 2. llama.cpp through llama-cpp-python, in a venv of its own.
if [ -n "${LLAMA_PY:-}" ]; then
  py="$LLAMA_PY"
else
  py="$venv/bin/python"
  if ! "$py" -c 'import llama_cpp, numpy' >/dev/null 2>&1; then
    command -v python3 >/dev/null || die "python3 is required"
    if [ ! -x "$py" ]; then
      say "creating $venv"
      python3 -m venv "$venv" || die "python3 -m venv failed (on Debian: apt-get install python3-venv)"
    fi
    say "installing llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION into $venv (first build compiles llama.cpp: 4-6 minutes)"
    # GGML_NATIVE tunes for this CPU; AMX code is left out because it
    # segfaults on the VMs this runs on. pip's wheel cache makes reinstalls fast.
    CMAKE_ARGS="-DGGML_NATIVE=ON" \
      CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
      CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
      "$py" -m pip install --disable-pip-version-check "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" numpy
  fi
fi
"$py" -c 'import llama_cpp, numpy' || die "$py cannot import llama_cpp and numpy"

# 3. Both engines per thread count, pinned to the same cores.
ncpu="$(nproc 2>/dev/null || echo 1)"
mkdir -p "$results"
reports=()
for t in $THREADS; do
  pin=()
  if [ "$t" -gt "$ncpu" ]; then
    say "threads $t > $ncpu CPUs: skipped"
    continue
  fi
  if command -v taskset >/dev/null; then
    pin=(taskset -c "$(seq -s, 0 $((t - 1)))")
  else
    say "taskset not found: threads $t runs unpinned"
  fi
  warn_if_busy
  say "threads $t: duet${pin:+ (${pin[*]})}"
  # shellcheck disable=SC2086  # DUET_ARGS is a list of flags
  ${pin[@]+"${pin[@]}"} "$duet" bench engine --model "$model" --threads "$t" \
    --steps "$STEPS" --batch "$BATCH" --prefill "$PREFILL" $DUET_ARGS \
    --json "$results/duet-engine-t$t.json"
  warn_if_busy
  say "threads $t: llama.cpp${pin:+ (${pin[*]})}"
  ${pin[@]+"${pin[@]}"} "$py" bench/llama_cpp_engine.py --model "$model" --threads "$t" \
    --steps "$STEPS" --batch "$BATCH" --prefill "$PREFILL" \
    --json "$results/llama-cpp-engine-t$t.json"
  reports+=("$results/duet-engine-t$t.json" "$results/llama-cpp-engine-t$t.json")
done
[ ${#reports[@]} -gt 0 ] || die "nothing was run (THREADS=\"$THREADS\")"

# 4. Side by side.
python3 bench/compare_engine.py --out "$results/engine-$(date +%Y-%m-%d).md" "${reports[@]}"
