#!/usr/bin/env bash
# `make image-cuda`: duet's CUDA image (deploy/docker/cuda.Dockerfile) with nothing pulled,
# then the checks a machine without a GPU can make of it. The last line is the image's tag.
#   1. duet-base:bookworm-2 (scripts/build-base-image.sh; once);
#   2. the cuda + nccl binary (scripts/build-cuda.sh, or DUET_CUDA_BINARY);
#   3. the CUDA user-space libraries from PyPI wheels (scripts/lib/cuda.sh pins them) into
#      .venv/cuda-image, and a stub libcuda.so.1 for nodes without a driver;
#   4. target/image-cuda/ staged (binary without line tables, libraries, stub, licences:
#      duet's, its crates', and the wheels' own licence files), docker build;
#   5. checks, each printed: the image starts; every library the binary needs resolves
#      inside it (ldd); `--device cuda` is refused with exit code 2 in
#      one line naming libcuda.so.1 (the stub answered); a node's driver, mounted where the
#      NVIDIA container toolkit puts it and the loader's cache refreshed as its hook does, is
#      the one loaded (a second stub that answers CUDA_ERROR_NO_DEVICE plays the driver);
#      `--device cpu --engine candle` in the image prints the host binary's tokens.
# What this cannot check: anything on a GPU (scripts/gpu-check.sh on a GPU machine).
# DUET_IMAGE_TAG names the image (default duet:<version>-cuda, also tagged duet:latest-cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/cuda.sh
source scripts/lib/cuda.sh
t0=$(date +%s)
say() { echo "build-cuda-image: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
./scripts/build-base-image.sh >&2
binary="${DUET_CUDA_BINARY:-}"
[ -n "$binary" ] || binary="$(./scripts/build-cuda.sh | tail -1)"
py=.venv/cuda/bin/python

# 3. Libraries: the same pins as the build, installed once per pin list.
libs=.venv/cuda-image
stamp="$libs/.pins"
if [ "$(cat "$stamp" 2>/dev/null)" != "${CUDA_IMAGE_WHEELS[*]}" ]; then
  rm -rf "$libs"
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target "$libs" \
    "${CUDA_IMAGE_WHEELS[@]}"
  echo "${CUDA_IMAGE_WHEELS[*]}" >"$stamp"
fi

# 4. Stage.
# shellcheck disable=SC1091
version="$(source .venv/cuda/env.sh && "$binary" --version | awk '{print $2}')"
commit="$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
ctx=target/image-cuda
node=target/image-cuda-node-driver
rm -rf "$ctx" "$node" && mkdir -p "$ctx/cuda" "$ctx/driver-stub" "$ctx/licenses/cuda" "$node"
strip --strip-debug -o "$ctx/duet" "$binary"
for so in libcudart.so.13 libnvrtc.so.13 libnvrtc-builtins.so.13 libcublas.so.13 \
  libcublasLt.so.13 libcurand.so.10 libnccl.so.2; do
  f="$(find "$libs/nvidia" -name "$so*" -type f | sort | head -1)"
  [ -n "$f" ] || fail "no $so in the wheels under $libs"
  cp "$f" "$ctx/cuda/$(basename "$f")"
  [ "$(basename "$f")" = "$so" ] || ln -s "$(basename "$f")" "$ctx/cuda/$so"
done
cudarc="$(cudarc_dir "$py")"
cuda_stub "$cudarc" "$ctx/driver-stub" cuda driver libcuda.so.1 34
rm -f "$ctx/driver-stub/stub_cuda.c" "$ctx/driver-stub/libcuda.so"
# For the check below only (not in the image): a "driver" that says there is no GPU.
cuda_stub "$cudarc" "$node" cuda driver libcuda.so.1 100
for d in "$libs"/nvidia_*.dist-info; do
  for l in "$d"/License.txt "$d"/LICENSE* "$d"/licenses/*; do
    [ -f "$l" ] && cp "$l" "$ctx/licenses/cuda/$(basename "$d" .dist-info)-$(basename "$l")"
  done
done
cp LICENSE "$ctx/licenses/LICENSE"
cargo metadata --format-version 1 --locked --filter-platform x86_64-unknown-linux-gnu \
  --features duet/cuda,duet/nccl | python3 scripts/third_party_licences.py >"$ctx/licenses/THIRD-PARTY.md"
tag="${DUET_IMAGE_TAG:-duet:$version-cuda}"
tags=(-t "$tag")
[ -n "${DUET_IMAGE_TAG:-}" ] || tags+=(-t duet:latest-cuda)
docker build -q -f deploy/docker/cuda.Dockerfile --build-arg VERSION="$version" \
  --build-arg COMMIT="$commit" "${tags[@]}" "$ctx" >&2
size=$(docker image inspect -f '{{.Size}}' "$tag")
say "$tag (commit $commit), $((size / 1048576)) MiB, built in $(( $(date +%s) - t0 )) s"

# 5. Checks. NVIDIA_VISIBLE_DEVICES=void: where Docker's default runtime is NVIDIA's (GPU
# hosts), the node's driver would otherwise be injected into these driverless checks.
nogpu=(-e NVIDIA_VISIBLE_DEVICES=void)
docker run --rm "${nogpu[@]}" "$tag" --version >&2 || fail "the image does not start"
# Every library the binary needs is in the image (the driver: the stub, here).
missing="$(docker run --rm "${nogpu[@]}" --entrypoint /bin/sh "$tag" -c 'ldd /usr/local/bin/duet' | awk '/not found/ {print $1}')"
[ -z "$missing" ] || fail "the binary needs libraries the image lacks: $missing"
say "ok: every library the binary needs resolves inside the image"
say "ok: starts without a driver"
models="$PWD/models"
run=(docker run --rm "${nogpu[@]}" -v "$models:/models:ro")
set +e
err="$("${run[@]}" "$tag" run --device cuda:0 --prompt Hi 2>&1 >/dev/null)"
code=$?
set -e
say "--device cuda:0 without a driver: exit $code: $err"
[ "$code" = 2 ] || fail "--device cuda: exit code $code, not 2"
[ "$(printf '%s\n' "$err" | wc -l)" = 1 ] || fail "--device cuda: not one line"
grep -q 'libcuda.so.1' <<<"$err" || fail "--device cuda: the refusal does not name libcuda.so.1"
grep -q 'STUB_LIBRARY' <<<"$err" || fail "--device cuda: not the image's stub that answered"
set +e
err="$("${run[@]}" --user 0 -v "$PWD/$node/libcuda.so.1:/usr/lib/x86_64-linux-gnu/libcuda.so.1:ro" \
  --entrypoint /bin/sh "$tag" -c 'ldconfig && exec /usr/local/bin/duet run --device cuda:0 --prompt Hi' 2>&1 >/dev/null)"
code=$?
set -e
say "--device cuda:0 with a node's driver mounted: exit $code: $err"
[ "$code" = 2 ] && grep -q 'NO_DEVICE' <<<"$err" ||
  fail "a node's libcuda.so.1 in /usr/lib/x86_64-linux-gnu is not the one loaded"
prompt="Explain in one sentence why the sky is blue."
# shellcheck disable=SC1091
want="$(source .venv/cuda/env.sh && "$binary" run --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
  --device cpu --engine candle --max-tokens 16 --prompt "$prompt" 2>/dev/null)"
got="$("${run[@]}" "$tag" run --device cpu --engine candle --max-tokens 16 --prompt "$prompt" 2>/dev/null)"
[ -n "$want" ] && [ "$got" = "$want" ] || fail "--device cpu --engine candle: '$got', host: '$want'"
say "ok: --device cpu --engine candle in the image prints the host's text: $got"
echo "$tag"
