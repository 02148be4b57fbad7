#!/usr/bin/env bash
# `make build-cuda`: the duet binary with the candle engine on CUDA (`--device cuda:N`) and
# KV over NCCL, built on any Linux x86 machine, with or without a GPU. Installs the CUDA 13.4
# toolkit from PyPI wheels first (scripts/install-cuda-toolkit.sh), then builds in the dev
# profile (the workspace's dev profile compiles the engine and every dependency at opt-level
# 3), so the tests of the same build reuse its CUDA kernels: every cargo profile compiles
# candle's kernels again, ~9 minutes on 2 cores.
# The binary is copied to target/cuda/duet; the last line printed is its path.
# Without a driver it starts (against stub libraries) and refuses `--device cuda` with exit
# code 2; on a GPU node it needs the driver's libcuda.so.1 and the env of .venv/cuda/env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-cuda-toolkit.sh >&2
# shellcheck disable=SC1091
source .venv/cuda/env.sh
FEATURES="${DUET_CUDA_FEATURES:-duet/cuda,duet/nccl}"
t0=$(date +%s)
# target/debug/duet is the CPU-only binary every other script and test runs: keep it.
cpu=target/debug/duet
[ -f "$cpu" ] && cp -p "$cpu" target/debug/.duet-cpu-only
cargo build -p duet --features "$FEATURES" >&2
mkdir -p target/cuda
cp "$cpu" target/cuda/duet
if [ -f target/debug/.duet-cpu-only ]; then mv target/debug/.duet-cpu-only "$cpu"; else rm -f "$cpu"; fi
echo "build-cuda: built with $FEATURES in $(( $(date +%s) - t0 )) s (CUDA_LIBS=$DUET_CUDA_LIBS); run it with: source .venv/cuda/env.sh" >&2
echo "$PWD/target/cuda/duet"
