#!/usr/bin/env bash
# `make image`: duet's container image with nothing pulled (no registry is reachable here).
#   1. duet-base:bookworm-2 from Debian's packages (scripts/build-base-image.sh; once);
#   2. the release binary (cargo build --release -p duet);
#   3. target/image/ staged: the binary and the licence files;
#   4. docker build -f deploy/docker/Dockerfile, tagged duet:<version> and duet:latest;
#   5. the image starts (duet --version as uid 65532).
# Prints the image's size and the build's time; the last line is the image's tag.
# DUET_BINARY=path puts that binary in instead of the release build (the container tests use
# the test build's, to spare CI a release compile), DUET_IMAGE_TAG names the image (default
# duet:<version>, also tagged duet:latest).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
./scripts/build-base-image.sh >&2
binary="${DUET_BINARY:-}"
if [ -z "$binary" ]; then
  cargo build --release -p duet >&2
  binary=target/release/duet
fi
version="$("$binary" --version | awk '{print $2}')"
commit="$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
ctx=target/image
rm -rf "$ctx" && mkdir -p "$ctx/licenses"
# Line tables stay out of the image (symbols stay: backtraces still name functions).
strip --strip-debug -o "$ctx/duet" "$binary"
cp LICENSE "$ctx/licenses/LICENSE"
cargo metadata --format-version 1 --locked --filter-platform x86_64-unknown-linux-gnu |
  python3 scripts/third_party_licences.py >"$ctx/licenses/THIRD-PARTY.md"
tag="${DUET_IMAGE_TAG:-duet:$version}"
tags=(-t "$tag")
[ -n "${DUET_IMAGE_TAG:-}" ] || tags+=(-t duet:latest)
docker build -q -f deploy/docker/Dockerfile --build-arg VERSION="$version" \
  --build-arg COMMIT="$commit" "${tags[@]}" "$ctx" >&2
docker run --rm "$tag" --version >&2
size=$(docker image inspect -f '{{.Size}}' "$tag")
echo "build-image: $tag (commit $commit), $((size / 1048576)) MiB, built in $(( $(date +%s) - t0 )) s" >&2
echo "$tag"
