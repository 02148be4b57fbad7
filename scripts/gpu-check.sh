#!/usr/bin/env bash
# For a machine with NVIDIA GPUs and a driver (never run on this project's machines: they have
# neither). One command, under 10 minutes after the build: builds duet with CUDA and checks on
# cuda:0 what CI can only check on candle's CPU device, then writes a JSON report that says
# exactly what passed, failed, or was not run and why.
#
#   ./scripts/gpu-check.sh [REPORT.json]      (default bench/results/gpu-check-<host>.json)
#   HBM_GBPS=3350 ./scripts/gpu-check.sh      the GPU's memory bandwidth (H100 SXM: 3350),
#                                             for the decode roofline ratio
#
# Steps (each one a key of the report's "steps"):
#   build             scripts/build-cuda.sh with the driver's libcuda and the cuBLAS/cuRAND/NCCL
#                     wheels (CUDA_LIBS=real)
#   reference         engine/tests/candle_parity.rs on cuda:0: the 10 llama.cpp reference
#                     prompts by the reference rule (>= 7 of 10 kept, first token 10 of 10),
#                     logits within the stated tolerance of the native CPU engine, batched and
#                     chunked forwards, KV export/import between the device pool and the CPU
#   bench_engine      duet bench engine --device cuda:0: prefill 512 and 2048 tokens, decode
#                     batch 1, 32, 128; decode batch 1 against the HBM roofline (weight bytes
#                     per step / step time >= 50% of HBM_GBPS is the target)
#   nccl_two_ranks    kv-transfer's NCCL round trip GPU 0 -> GPU 1 (needs two GPUs)
#   disaggregated_up  duet up --device cuda:0 --kv-transport shm: prefill and decode workers on
#                     one GPU, KV through the host cache (CUDA IPC is not built yet); a remote
#                     prefill's greedy tokens must equal duet run --device cuda:0's
#   image             scripts/build-cuda-image.sh from that binary (its own checks), then
#                     `docker run --gpus all` of it: greedy tokens on cuda:0 inside the image
#                     equal the host binary's (needs Docker with the NVIDIA container toolkit)
set -euo pipefail
cd "$(dirname "$0")/.."
report="${1:-bench/results/gpu-check-$(hostname).json}"
mkdir -p "$(dirname "$report")" target/gpu-check
log=target/gpu-check
declare -A status
steps="$log/steps.tsv"
: >"$steps"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
record() {
  status[$1]=$2
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$steps"
  echo "gpu-check: $1: $2 ($3) t=$(elapsed)s"
}

gpus="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true)"
ngpu="$(printf '%s' "$gpus" | grep -c . || true)"
[ "$ngpu" -ge 1 ] || { echo "gpu-check: nvidia-smi lists no GPU; this script is for a GPU machine" >&2; exit 1; }

if bin="$(CUDA_LIBS=real ./scripts/build-cuda.sh 2>"$log/build.log" | tail -1)" && [ -x "$bin" ]; then
  record build pass "$bin"
else
  record build fail "see $log/build.log"
fi
# shellcheck disable=SC1091
[ -f .venv/cuda/env.sh ] && source .venv/cuda/env.sh

if [ "${status[build]}" = pass ]; then
  if DUET_TEST_DEVICE=cuda:0 cargo test -p duet-engine -p duet --features duet/cuda,duet/nccl \
    --test candle_parity -- --nocapture >"$log/reference.log" 2>&1; then
    record reference pass "candle_parity on cuda:0, $log/reference.log"
  else
    record reference fail "see $log/reference.log"
  fi
  if "$bin" bench engine --model models/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda:0 \
    --prefill 512,2048 --batch 1,32,128 --context 512 --steps 32 \
    --json "$log/bench-engine.json" >"$log/bench-engine.log" 2>&1; then
    roof="$(python3 - "$log/bench-engine.json" "${HBM_GBPS:-}" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
d1 = next(d for d in r["decode"] if d["batch"] == 1)
gbps = r["weight_bytes"] / (d1["seconds"] / d1["steps"]) / 1e9
ratio = f", {gbps / float(sys.argv[2]):.2f}x of HBM {sys.argv[2]} GB/s (target >= 0.50)" if sys.argv[2] else ", set HBM_GBPS for the ratio"
print(f"decode batch 1: {gbps:.0f} GB/s of weights per step{ratio}")
EOF
)"
    record bench_engine pass "$roof; $log/bench-engine.json"
  else
    record bench_engine fail "see $log/bench-engine.log"
  fi
  if [ "$ngpu" -ge 2 ]; then
    if DUET_GPU_CHECK=1 cargo test -p duet-kv-transfer --features nccl --test nccl -- --nocapture \
      >"$log/nccl.log" 2>&1; then
      record nccl_two_ranks pass "$log/nccl.log"
    else
      record nccl_two_ranks fail "see $log/nccl.log"
    fi
  else
    record nccl_two_ranks not_run "one GPU here; needs two"
  fi
else
  for s in reference bench_engine nccl_two_ranks; do record "$s" not_run "the build failed"; done
fi
# One prompt long enough to be prefilled remotely, through a disaggregated duet up on device $1
# against duet run on the same device: same greedy tokens, placement remote.
disaggregated_up() {
  local dev=$1 prompt ids_run out pid
  prompt="$(python3 -c 'print("Summarize the history of the printing press in Europe, from Gutenberg onwards, covering literacy and the Reformation. " * 6)')"
  ids_run="$("$bin" run --device "$dev" --prompt "$prompt" --max-tokens 16 --json 2>>"$log/up.log" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["ids"])')" || return 1
  "$bin" up --device "$dev" --kv-transport shm --listen 127.0.0.1:18551 --http-listen 127.0.0.1:18552 \
    >>"$log/up.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do
    out="$("$bin" generate --router http://127.0.0.1:18551 --prompt "$prompt" --max-tokens 16 --json 2>>"$log/up.log")" && break
    sleep 1
  done
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
  [ -n "$out" ] || return 1
  python3 - "$out" "$ids_run" <<'EOF'
import ast, json, sys
got, want = json.loads(sys.argv[1]), ast.literal_eval(sys.argv[2])
print(f"placement {got['timings']['placement']}, ids equal duet run's: {got['ids'] == want}")
sys.exit(0 if got["ids"] == want and "REMOTE" in str(got["timings"]["placement"]).upper() else 1)
EOF
}
if [ "${status[build]}" = pass ]; then
  if d="$(disaggregated_up cuda:0)"; then
    record disaggregated_up pass "$d; $log/up.log"
  else
    record disaggregated_up fail "${d:-no answer}; see $log/up.log"
  fi
else
  record disaggregated_up not_run "the build failed"
fi

# The CUDA image on this GPU: the node's driver mounted by the NVIDIA container toolkit.
image_on_gpu() {
  local tag want got prompt="Explain in one sentence why the sky is blue."
  tag="$(DUET_CUDA_BINARY="$bin" ./scripts/build-cuda-image.sh 2>>"$log/image.log" | tail -1)" || return 1
  want="$("$bin" run --device cuda:0 --prompt "$prompt" --max-tokens 16 --json 2>>"$log/image.log" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["ids"])')" || return 1
  got="$(docker run --rm --gpus all -v "$PWD/models:/models:ro" "$tag" run --device cuda:0 \
    --prompt "$prompt" --max-tokens 16 --json 2>>"$log/image.log" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["ids"])')" || return 1
  echo "$tag on cuda:0: ids equal the host's: $([ "$got" = "$want" ] && echo yes || echo no)"
  [ "$got" = "$want" ]
}
if [ "${status[build]}" != pass ]; then
  record image not_run "the build failed"
elif ! docker info 2>/dev/null | grep -qi nvidia; then
  record image not_run "Docker with the NVIDIA runtime is not here"
elif d="$(image_on_gpu)"; then
  record image pass "$d; $log/image.log"
else
  record image fail "${d:-no answer}; see $log/image.log"
fi

python3 - "$report" "$steps" "$gpus" "$(elapsed)" "$(git rev-parse HEAD 2>/dev/null || echo unknown)" <<'EOF'
import json, sys
report, tsv, gpus, seconds, commit = sys.argv[1:]
steps = {}
for line in open(tsv):
    name, status, detail = line.rstrip("\n").split("\t", 2)
    steps[name] = {"status": status, "detail": detail}
out = {
    "gpus": gpus.splitlines(),
    "seconds": int(seconds),
    "commit": commit,
    # Every step that could run here passed ("not_run" / "not_built" say why one did not).
    "passed": steps["build"]["status"] == "pass"
    and all(s["status"] != "fail" for s in steps.values()),
    "steps": steps,
}
json.dump(out, open(report, "w"), indent=2)
print(json.dumps(out, indent=2))
EOF
echo "gpu-check: report in $report"
# Exit status: 0 only if the report says passed.
python3 -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["passed"] else 1)' "$report"
