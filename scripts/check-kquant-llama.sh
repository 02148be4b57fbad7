#!/usr/bin/env bash
# End-to-end check of duet's K-quant kernels against llama.cpp: for each of Q4_K, Q5_K
# and Q6_K, a variant of the default model whose ffn_down matrices are re-quantized to
# that type by llama.cpp's own quantizer (bench/make_kquant_variant.py), llama.cpp's
# logits for the reference prompts and 3 greedy steps on it
# (bench/llama_cpp_logits_fixture.py), then engine/tests/bit_exact.rs on the variant.
#
# On an AVX-512 machine (the build that recorded duet's references) duet's logits must
# hash to llama.cpp's: prompt whole and in chunks of 5, 1 and 2 threads.
# On an AVX2-only machine llama.cpp's attention and expf round differently from the
# AVX-512 build duet follows, so no logits are bit-identical, not even the Q4_1 model's.
# The script then reports, per model, the largest difference over llama.cpp's top-20
# logits after the prompt, the unmodified Q4_1 model first: the K-quant kernels are
# right when their variants differ no more than it does.
#
# Needs llama-cpp-python 0.3.36 with gguf-py in .venv/llama (installed here as
# scripts/bench-engine.sh does: the first build compiles llama.cpp, 4-6 minutes). Not
# part of `make test`: CI does not build llama.cpp. Results: bench/results/kquant-llama/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv/llama"
out="$root/bench/results/kquant-llama"
say() { echo "check-kquant-llama: $*" >&2; }

./scripts/fetch-model.sh
if ! "$venv/bin/python" -c 'import llama_cpp, numpy, gguf' >/dev/null 2>&1; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  say "installing llama-cpp-python==0.3.36 and gguf==0.19.0 into $venv (first build: 4-6 minutes)"
  CMAKE_ARGS="-DGGML_NATIVE=ON" \
    CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
    CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "llama-cpp-python==0.3.36" numpy "gguf==0.19.0"
fi
avx512=0
grep -qw avx512f /proc/cpuinfo && avx512=1
mkdir -p "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
status=0
summary="$out/summary.txt"
: > "$summary"
for kind in ${TYPES:-q4_1 q4_k q5_k q6_k}; do
  if [ "$kind" = q4_1 ]; then
    [ "$avx512" = 1 ] && continue # tests/data/llama-cpp-logits.json covers it: make test
    model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  else
    model="$tmp/smollm2-ffn_down-$kind.gguf"
    "$venv/bin/python" bench/make_kquant_variant.py "$kind" "$model" >&2
  fi
  fixture="$out/llama-cpp-logits-$kind.json"
  DUET_MODEL="$model" DUET_LOGITS_FIXTURE="$fixture" DUET_FIXTURE_ANY_CPU=$((1 - avx512)) \
    "$venv/bin/python" bench/llama_cpp_logits_fixture.py >&2
  log="$out/bit_exact-$kind.log"
  DUET_MODEL="$model" DUET_LOGITS_FIXTURE="$fixture" \
    cargo test -q -p duet-engine --test bit_exact >"$log" 2>&1 || true
  if grep -q "test result: ok" "$log"; then
    line="$kind: bit for bit (prompt whole and in chunks of 5, 1 and 2 threads)"
  else
    worst="$(grep -o 'largest difference over its top 20: [0-9.e-]*' "$log" | awk '{print $NF}' | sort -g | tail -1)"
    line="$kind: not bit-identical; largest top-20 logit difference after the prompt: ${worst:-?}"
    [ "$avx512" = 1 ] && status=1
  fi
  say "$line"
  echo "$line" >> "$summary"
done
echo "llama.cpp build: $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['ggml_cpu'])" "$fixture")" >> "$summary"
cat "$summary"
exit "$status"
