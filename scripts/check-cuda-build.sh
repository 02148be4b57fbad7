#!/usr/bin/env bash
# The CUDA build, checked on a machine without a GPU (CI, `make test`): the toolkit from PyPI
# wheels, then in ONE cargo profile (dev, so candle's CUDA kernels compile once):
#   1. build the binary with cuda + nccl (scripts/build-cuda.sh);
#   2. run cli/tests/cuda_build.rs against that build: the binary starts against the stub
#      driver, `--device cuda` is refused with exit code 2 naming libcuda.so.1, and
#      `--device cpu --engine candle` still gives llama.cpp's tokens. The feature changes no
#      line of the engine's or the CLI's code (only candle's and cudarc's builds), so their
#      unit tests and engine/tests/candle_parity.rs, which `make test` runs on the default
#      build, would run the same code again;
#   3. clippy -D warnings on the crates with CUDA code, with cuda alone and with cuda + nccl;
#   4. the CUDA image from that binary and its checks without a driver
#      (scripts/build-cuda-image.sh).
# What this cannot check: anything on a GPU (scripts/gpu-check.sh, on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
step() { echo "check-cuda-build: $1 (t=$(( $(date +%s) - t0 )) s)"; }
# The tests below link the cuda binary to target/debug/duet (cargo's copy of the last build);
# put the CPU-only one back afterwards, whatever happens.
[ -f target/debug/duet ] && cp -p target/debug/duet target/debug/.duet-before-cuda
trap '[ -f target/debug/.duet-before-cuda ] && mv target/debug/.duet-before-cuda target/debug/duet' EXIT
bin="$(./scripts/build-cuda.sh | tail -1)"
step "built $bin"
# shellcheck disable=SC1091
source .venv/cuda/env.sh
[ "$DUET_CUDA_LIBS" = stub ] || echo "check-cuda-build: real CUDA libraries here: the tests expect a GPU" >&2
F=duet/cuda,duet/nccl
cargo test -p duet --features "$F" --test cuda_build
step "tests passed"
cargo clippy -p duet-engine -p duet-kv-transfer -p duet --all-targets --features "$F" -- -D warnings
cargo clippy -p duet-engine -p duet --all-targets --features duet/cuda -- -D warnings
step "clippy clean"
DUET_CUDA_BINARY="$bin" ./scripts/build-cuda-image.sh >/dev/null
step "CUDA image built and checked"
