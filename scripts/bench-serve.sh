#!/usr/bin/env bash
# Serving benchmark: the same workload, model and 2 cores under four configurations, each
# loaded by `duet bench serve` over a sweep of Poisson request rates. Run by hand (not in
# CI) on an otherwise idle machine; see docs/benchmarks.md.
#
#   disaggregated  duet prefill (core 0, 1 thread) + duet decode (core 1, 1 thread) +
#                  duet router, separate processes around an etcd this script starts;
#                  every prompt prefilled remotely (--local-prefill-max-tokens 0)
#   colocated      duet up --mode colocated --prefill-workers 0 --decode-workers 1
#                  --threads 2 (cores 0,1)
#   conditional    disaggregated, but prompts up to 256 tokens prefilled on the decode
#                  worker (--local-prefill-max-tokens 256)
#   llama          llama.cpp's llama-server -t 2, continuous batching over LLAMA_SLOTS
#                  parallel slots (cores 0,1), built from the llama-cpp-python sdist
#                  (LLAMA_SERVER=/path/to/llama-server to use another build, or
#                  LLAMA_SERVER=python for llama-cpp-python's own server, which has no
#                  parallel slots: one request at a time)
#
# Every rate repeats one workload, so duet's workers run with --prefix-cache off (as
# llama-server gets "cache_prompt": false): later rates would otherwise measure cache hits.
#
# Steps: (1) every configuration unloaded (one request at a time) -> base TTFT and TPOT
# p90 = the lowest over the configurations; (2) SLO = TTFT_SCALE x base TTFT, TPOT_SCALE x
# base TPOT (written to slo.json and printed); (3) every configuration over the rate sweep
# with that SLO; (4) overlay plots and a goodput table. Router, etcd and the load generator
# are not pinned (they use little CPU); the workers are.
#
# Environment (defaults in brackets):
#   CONFIGS       configurations to run ["disaggregated colocated conditional llama"]
#   RATES         offered request rates, req/s ["0.25,0.5,1,1.5,2,3"]
#   NUM_PROMPTS   measured requests per rate [60]
#   UNLOADED      requests of the unloaded run [10]
#   WARMUP        warm-up requests before each configuration's runs [2]
#   DATASET       workload flags for duet bench serve
#                 ["--dataset azure-conv --length-scale 0.25 --max-input-len 1024 --max-output-len 256"]
#   SEED          workload seed [0]
#   TTFT_SCALE, TPOT_SCALE  SLO multiples of the unloaded p90 [5, 3]
#   SLO_TTFT_MS, SLO_TPOT_MS  a fixed SLO instead (e.g. to extend an earlier run)
#   DUET_BACKEND  how duet is loaded: duet (gRPC door) or openai (its HTTP door) [duet]
#   KV_SHM        KV between the separate worker processes over shared memory (on) or
#                 loopback tcp, as between hosts (off) [off: what docs/benchmarks.md measured]
#   LLAMA_SLOTS   llama-server parallel slots [4]
#   OUT           results directory [bench/results/serve-<date>]
#   SMOKE=1       a tiny run to check the script works (2 rates x 4 requests, short
#                 prompts, results in a temporary directory unless OUT is set)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

say() { echo "bench-serve: $*" >&2; }
die() { say "$*"; exit 1; }

CONFIGS="${CONFIGS:-disaggregated colocated conditional llama}"
RATES="${RATES:-0.25,0.5,1,1.5,2,3}"
NUM_PROMPTS="${NUM_PROMPTS:-60}"
UNLOADED="${UNLOADED:-10}"
WARMUP="${WARMUP:-2}"
DATASET="${DATASET:---dataset azure-conv --length-scale 0.25 --max-input-len 1024 --max-output-len 256}"
SEED="${SEED:-0}"
TTFT_SCALE="${TTFT_SCALE:-5}"
TPOT_SCALE="${TPOT_SCALE:-3}"
DUET_BACKEND="${DUET_BACKEND:-duet}"
LLAMA_SLOTS="${LLAMA_SLOTS:-4}"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
if [ "${SMOKE:-0}" = 1 ]; then
  RATES="${SMOKE_RATES:-1,2}"
  NUM_PROMPTS=4
  UNLOADED=2
  WARMUP=1
  DATASET="--dataset uniform --input-len 48 --output-len 8 --range-ratio 0.5"
  OUT="${OUT:-$(mktemp -d /tmp/duet-bench-serve-smoke.XXXXXX)}"
fi
OUT="${OUT:-$root/bench/results/serve-$(date +%F)}"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
venv="$root/.venv/llama"
mkdir -p "$OUT"
logs="$OUT/logs"
mkdir -p "$logs"

# 1. Model and duet (release).
./scripts/fetch-model.sh
cargo build --release -p duet
duet="${CARGO_TARGET_DIR:-$root/target}/release/duet"
# Separate duet processes refuse to start without the cluster secret: one for this run.
export DUET_KV_SECRET_FILE="$(mktemp)"
head -c 32 /dev/urandom | base64 > "$DUET_KV_SECRET_FILE"
[ -x "$duet" ] || die "$duet not found after cargo build"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
stop_etcd() {
  if [ -n "${etcd_pid:-}" ]; then kill "$etcd_pid" 2>/dev/null || true; wait "$etcd_pid" 2>/dev/null || true; fi
  if [ -n "${etcd_dir:-}" ]; then rm -rf "$etcd_dir"; fi
}
trap 'cleanup; stop_etcd' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# shellcheck source=lib/wait.sh
source "$root/scripts/lib/wait.sh"

# etcd for the disaggregated configurations (single member, free ports, fresh data dir).
etcd_dir=""
etcd_ep=""
etcd_pid=""
start_etcd() {
  [ -n "$etcd_ep" ] && return 0
  command -v etcd >/dev/null || die "etcd not found (apt-get install etcd-server, or ./scripts/install-test-deps.sh)"
  etcd_dir="$(mktemp -d /tmp/duet-bench-etcd.XXXXXX)"
  local cp pp
  cp=$(free_port); pp=$(free_port)
  etcd --name=bench --data-dir="$etcd_dir/data" \
    --listen-client-urls="http://127.0.0.1:$cp" --advertise-client-urls="http://127.0.0.1:$cp" \
    --listen-peer-urls="http://127.0.0.1:$pp" --initial-advertise-peer-urls="http://127.0.0.1:$pp" \
    --initial-cluster="bench=http://127.0.0.1:$pp" --initial-cluster-state=new \
    --logger=zap --log-outputs=stderr >"$logs/etcd.log" 2>&1 &
  etcd_pid=$!
  etcd_ep="http://127.0.0.1:$cp"
  for _ in $(seq 150); do
    curl -sf "$etcd_ep/health" | grep -q '"health":"true"' && return 0
    sleep 0.1
  done
  die "etcd did not become healthy (see $logs/etcd.log)"
}

# llama.cpp's llama-server, built once from the llama-cpp-python sdist into .venv.
llama_server_bin() {
  if [ -n "${LLAMA_SERVER:-}" ]; then echo "$LLAMA_SERVER"; return 0; fi
  local bin="$root/.venv/llama-server/build/bin/llama-server"
  if [ ! -x "$bin" ]; then
    command -v python3 >/dev/null || die "python3 is required"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    local src="$root/.venv/llama-server"
    mkdir -p "$src"
    say "building llama-server $LLAMA_CPP_PYTHON_VERSION from the llama-cpp-python sdist (first time: 10-20 minutes)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check cmake scikit-build-core >&2
    "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-build-isolation \
      --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$src" >&2
    tar xzf "$src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$src"
    # AMX code segfaults on the VMs this runs on (see ../shared/README.md); no web UI, no
    # TLS, nothing fetched at build time.
    "$venv/bin/cmake" -S "$src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" \
      -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
      -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
      >"$logs/llama-server-cmake.log" 2>&1 || die "cmake configure failed (see $logs/llama-server-cmake.log)"
    "$venv/bin/cmake" --build "$src/build" --target llama-server -j "$(nproc)" \
      >>"$logs/llama-server-cmake.log" 2>&1 || die "llama-server build failed (see $logs/llama-server-cmake.log)"
  fi
  echo "$bin"
}

# llama-cpp-python's server (LLAMA_SERVER=python): needs the [server] extra.
llama_python() {
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if ! "$venv/bin/python" -c 'import llama_cpp.server, uvicorn' >/dev/null 2>&1; then
    say "installing llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION into $venv (first build compiles llama.cpp: 4-6 minutes)"
    CMAKE_ARGS="-DGGML_NATIVE=ON" \
      CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
      CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
      "$venv/bin/python" -m pip install -q --disable-pip-version-check "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" >&2
  fi
  echo "$venv/bin/python"
}

# Starts configuration $1; sets `url` and `client_flags` (backend and format flags).
start_config() {
  local name=$1 log="$logs/$1"
  case "$name" in
    disaggregated | conditional)
      start_etcd
      local cluster="bench-$name-$RANDOM" local_max=0
      [ "$name" = conditional ] && local_max=256
      taskset -c 1 "$duet" decode --model "$model" --threads 1 --etcd "$etcd_ep" --cluster "$cluster" \
        --listen 127.0.0.1:0 --kv-listen 127.0.0.1:0 --kv-pool 256MiB --prefix-cache off \
        --kv-shm "${KV_SHM:-off}" >"$log-decode.log" 2>&1 &
      pids+=($!)
      taskset -c 0 "$duet" prefill --model "$model" --threads 1 --etcd "$etcd_ep" --cluster "$cluster" \
        --listen 127.0.0.1:0 --kv-pool 256MiB --prefix-cache off \
        --kv-shm "${KV_SHM:-off}" >"$log-prefill.log" 2>&1 &
      pids+=($!)
      wait_line "$log-decode.log" "serving gRPC on" >/dev/null
      wait_line "$log-prefill.log" "serving gRPC on" >/dev/null
      "$duet" router --model "$model" --etcd "$etcd_ep" --cluster "$cluster" \
        --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --local-prefill-max-tokens "$local_max" \
        >"$log-router.log" 2>&1 &
      pids+=($!)
      local grpc http
      grpc=$(wait_line "$log-router.log" "router listening on")
      http=$(wait_line "$log-router.log" "http listening on")
      wait_duet "$grpc"
      duet_flags "$grpc" "$http"
      ;;
    colocated)
      taskset -c 0,1 "$duet" up --model "$model" --mode colocated --prefill-workers 0 --decode-workers 1 \
        --threads 2 --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --kv-pool 256MiB --prefix-cache off >"$log.log" 2>&1 &
      pids+=($!)
      local grpc http
      grpc=$(wait_line "$log.log" "router listening on")
      http=$(wait_line "$log.log" "http listening on")
      wait_duet "$grpc"
      duet_flags "$grpc" "$http"
      ;;
    llama)
      local port; port=$(free_port)
      if [ "${LLAMA_SERVER:-}" = python ]; then
        local py; py=$(llama_python)
        taskset -c 0,1 "$py" -m llama_cpp.server --model "$model" --n_threads 2 --n_threads_batch 2 \
          --n_ctx 4096 --host 127.0.0.1 --port "$port" --interrupt_requests False --verbose False \
          >"$log.log" 2>&1 &
        pids+=($!)
        # No token-id prompts and no ignore_eos in llama-cpp-python: text, min_tokens.
        client_flags=(--backend openai --prompt-format text --ignore-eos-param min-tokens)
      else
        local bin; bin=$(llama_server_bin)
        # Every slot gets the context of the longest request (1024 + 256 tokens) and more.
        taskset -c 0,1 "$bin" -m "$model" -t 2 -tb 2 -np "$LLAMA_SLOTS" -cb -c $((LLAMA_SLOTS * 2048)) \
          --host 127.0.0.1 --port "$port" >"$log.log" 2>&1 &
        pids+=($!)
        # The sweep repeats one workload at every rate: without cache_prompt=false,
        # llama-server would reuse the KV of prompts it saw at the previous rate (duet has
        # no prefix cache yet), and later rates would measure cache hits.
        client_flags=(--backend openai --prompt-format tokens --ignore-eos-param ignore-eos
          --extra-body '{"cache_prompt": false}')
      fi
      url="http://127.0.0.1:$port"
      for _ in $(seq 600); do
        curl -sf "$url/v1/models" >/dev/null 2>&1 && break
        sleep 0.2
      done
      curl -sf "$url/v1/models" >/dev/null || die "llama.cpp server did not start (see $log.log)"
      ;;
    *) die "unknown configuration '$name' (disaggregated, colocated, conditional, llama)" ;;
  esac
}

duet_flags() { # grpc-url http-url
  if [ "$DUET_BACKEND" = openai ]; then
    url=$2
    client_flags=(--backend openai --prompt-format tokens --ignore-eos-param ignore-eos)
  else
    url=$1
    client_flags=(--backend duet)
  fi
}

serve() { # label, extra flags...
  local label=$1; shift
  # shellcheck disable=SC2086  # DATASET is a list of flags
  "$duet" bench serve --model "$model" --url "$url" "${client_flags[@]}" --label "$label" \
    $DATASET --seed "$SEED" "$@"
}

p90() { # report.json metric -> p90 in ms of the (single) run
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['runs'][0]['summary'][sys.argv[2]]['p90'])" "$1" "$2"
}

# 2. Unloaded latencies (one request at a time).
say "results in $OUT"
for c in $CONFIGS; do
  say "$c: unloaded ($UNLOADED requests, one at a time)"
  start_config "$c"
  serve "$c" --max-concurrency 1 --num-prompts "$UNLOADED" --warmup "$WARMUP" \
    --output-json "$OUT/unloaded-$c.json" --quiet
  cleanup
done

# 3. The SLO: multiples of the best unloaded p90 over the configurations.
read -r base_ttft base_tpot < <(python3 - "$OUT" $CONFIGS <<'EOF'
import json, sys
out, configs = sys.argv[1], sys.argv[2:]
ttft, tpot = [], []
for c in configs:
    s = json.load(open(f"{out}/unloaded-{c}.json"))["runs"][0]["summary"]
    ttft.append(s["ttft_ms"]["p90"])
    tpot.append(s["tpot_ms"]["p90"])
print(min(ttft), min(tpot))
EOF
)
[ -n "${base_tpot:-}" ] || die "no unloaded TTFT/TPOT to set the SLO from (see $OUT/unloaded-*.json)"
slo_ttft=$(python3 -c "print(round($base_ttft * $TTFT_SCALE, 1))")
slo_tpot=$(python3 -c "print(round($base_tpot * $TPOT_SCALE, 1))")
# SLO_TTFT_MS / SLO_TPOT_MS: a fixed SLO (to add configurations or rates to an earlier run).
slo_ttft="${SLO_TTFT_MS:-$slo_ttft}"
slo_tpot="${SLO_TPOT_MS:-$slo_tpot}"
cat >"$OUT/slo.json" <<EOF
{"base_ttft_p90_ms": $base_ttft, "base_tpot_p90_ms": $base_tpot,
 "ttft_scale": $TTFT_SCALE, "tpot_scale": $TPOT_SCALE,
 "slo_ttft_ms": $slo_ttft, "slo_tpot_ms": $slo_tpot,
 "configs": "$CONFIGS", "rates": "$RATES", "num_prompts": $NUM_PROMPTS, "dataset": "$DATASET", "seed": $SEED}
EOF
say "SLO: TTFT <= $slo_ttft ms ($TTFT_SCALE x unloaded p90 $base_ttft ms), TPOT <= $slo_tpot ms ($TPOT_SCALE x unloaded p90 $base_tpot ms)"

# 4. The sweep, one configuration at a time.
reports=()
for c in $CONFIGS; do
  say "$c: rates $RATES, $NUM_PROMPTS requests each"
  start_config "$c"
  serve "$c" --rate-sweep "$RATES" --num-prompts "$NUM_PROMPTS" --warmup "$WARMUP" \
    --slo "ttft=$slo_ttft,tpot=$slo_tpot" --output-json "$OUT/$c.json" | tee "$OUT/$c.txt"
  cleanup
  reports+=("$OUT/$c.json")
done

# 5. Plots and the goodput table.
"$duet" bench plot --out "$OUT/plots" "${reports[@]}" >/dev/null
python3 - "${reports[@]}" <<'EOF' | tee "$OUT/goodput.md"
import json, sys
print("| configuration | goodput (req/s, attainment >= target) | attainment per rate |")
print("|---|---|---|")
for path in sys.argv[1:]:
    d = json.load(open(path))
    sw = d.get("sweep") or {}
    pts = ", ".join(f"{p['rate']}: {p['attainment']:.0%}" for p in sw.get("points", []))
    g = sw.get("goodput_rate")
    print(f"| {d['label']} | {g if g is not None else 'none'} | {pts} |")
EOF
say "done: $OUT (plots in $OUT/plots)"
