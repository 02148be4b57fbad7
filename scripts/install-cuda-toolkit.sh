#!/usr/bin/env bash
# Install the CUDA toolkit that `--features duet/cuda` builds with, from PyPI wheels only
# (no NVIDIA repository, no driver), into .venv/cuda, and write .venv/cuda/env.sh, which
# build-cuda.sh and check-cuda-build.sh source. Idempotent; about 500 MB.
#
# CUDA 13.4: the newest version cudarc 0.19.10 accepts (.cargo/config.toml pins its bindings
# with CUDARC_CUDA_VERSION=13040); the cu12 nvcc wheel ships no nvcc binary. Every wheel is
# pinned and installed with --no-deps: unpinned installs mix 13.4 and 13.5 parts.
#
# Libraries the binary links (candle builds cudarc with `dynamic-linking`):
#   libcuda.so.1 (the driver: never on PyPI), libcublas/cublasLt.so.13, libcurand.so.10,
#   libcudart.so.13, libnvrtc.so.13, and libnccl.so.2 with the nccl feature.
# CUDA_LIBS decides where they come from:
#   real  (default where a driver is installed: `ldconfig -p` lists libcuda.so.1) the
#         driver's libcuda plus the cuBLAS, cuRAND and NCCL wheels (~1 GB more);
#   stub  (default elsewhere, e.g. CI) link-and-start stubs generated from cudarc's own symbol
#         lists; every call returns an error (CUDA_ERROR_STUB_LIBRARY for the driver), so a
#         binary starts and refuses `--device cuda` cleanly. Stubs are never used where a
#         driver exists.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/cuda.sh
source scripts/lib/cuda.sh
ROOT="$PWD/.venv/cuda"

driver="$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 / {print $NF; exit}')"
CUDA_LIBS="${CUDA_LIBS:-$([ -n "$driver" ] && echo real || echo stub)}"
case "$CUDA_LIBS" in
  real) [ -n "$driver" ] || { echo "install-cuda-toolkit: CUDA_LIBS=real but no libcuda.so.1 (no NVIDIA driver)" >&2; exit 1; } ;;
  stub) [ -z "$driver" ] || { echo "install-cuda-toolkit: refusing stub libraries on a machine with a driver ($driver)" >&2; exit 1; } ;;
  *) echo "install-cuda-toolkit: CUDA_LIBS must be real or stub, not '$CUDA_LIBS'" >&2; exit 1 ;;
esac

[ -x "$ROOT/bin/python" ] || python3 -m venv "$ROOT"
pip=("$ROOT/bin/pip" install --quiet --disable-pip-version-check --no-deps)
"${pip[@]}" "${CUDA_WHEELS[@]}"
[ "$CUDA_LIBS" = stub ] || "${pip[@]}" "${CUDA_RUNTIME_WHEELS[@]}"
site="$("$ROOT/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
CU="$site/nvidia/cu13"
[ -x "$CU/bin/nvcc" ] || { echo "install-cuda-toolkit: no nvcc under $CU/bin" >&2; exit 1; }

# The link directory cudarc searches ($CUDA_HOME/lib): unversioned names for the linker.
lib="$ROOT/home/lib"
rm -rf "$lib" && mkdir -p "$lib"
ln -s "$CU/lib/libcudart.so.13" "$lib/libcudart.so"
ln -s "$CU/lib/libnvrtc.so.13" "$lib/libnvrtc.so"
if [ "$CUDA_LIBS" = real ]; then
  ln -s "$driver" "$lib/libcuda.so"
  for so in libcublas.so.13 libcublasLt.so.13; do ln -s "$CU/lib/$so" "$lib/${so%.13}"; done
  ln -s "$CU/lib/libcurand.so.10" "$lib/libcurand.so"
  ln -s "$site/nvidia/nccl/lib/libnccl.so.2" "$lib/libnccl.so"
  runtime="$CU/lib:$site/nvidia/nccl/lib"
else
  # Stub symbols: every function cudarc's bindings load, from its own sources.
  cudarc="$(cudarc_dir "$ROOT/bin/python")"
  for spec in cuda:driver:libcuda.so.1:34 cublas:cublas:libcublas.so.13:1 \
    cublasLt:cublaslt:libcublasLt.so.13:1 curand:curand:libcurand.so.10:101 nccl:nccl:libnccl.so.2:1; do
    IFS=: read -r name module soname ret <<<"$spec"
    cuda_stub "$cudarc" "$lib" "$name" "$module" "$soname" "$ret"
  done
  runtime="$lib:$CU/lib"
fi

cap="${CUDA_COMPUTE_CAP:-}"
if [ -z "$cap" ] && command -v nvidia-smi >/dev/null; then
  cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .)"
fi
cat >"$ROOT/env.sh" <<EOF
# Written by scripts/install-cuda-toolkit.sh (CUDA_LIBS=$CUDA_LIBS). Source it before a cuda build.
export PATH="$CU/bin:\$PATH"
export CUDA_HOME="$ROOT/home"
export CUDA_COMPUTE_CAP="${cap:-90}"
export CUDAFORGE_THREADS="\${CUDAFORGE_THREADS:-\$(nproc)}"
export LD_LIBRARY_PATH="$runtime\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export DUET_CUDA_LIBS=$CUDA_LIBS
EOF
echo "install-cuda-toolkit: CUDA 13.4 at $CU ($CUDA_LIBS libraries, compute capability ${cap:-90}); env in $ROOT/env.sh"
