#!/usr/bin/env bash
# Fuzzes the KV-transfer frame decoder with cargo-fuzz (libFuzzer) for a set time.
#   kv-transfer/fuzz/run.sh [SECONDS]      (default 60)
# Needs a nightly toolchain or RUSTC_BOOTSTRAP=1, and cargo-fuzz (`cargo install cargo-fuzz`).
# Corpus and crashes stay under kv-transfer/fuzz/{corpus,artifacts}/ (not committed).
set -euo pipefail
seconds="${1:-60}"
cd "$(dirname "$0")/.."
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is not installed: cargo install cargo-fuzz" >&2
    exit 2
fi
if ! rustc --version | grep -q nightly; then
    export RUSTC_BOOTSTRAP=1
fi
mkdir -p fuzz/corpus/frame_decoder
exec cargo fuzz run frame_decoder fuzz/corpus/frame_decoder -- \
    -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048
