# Sourced by install-cuda-toolkit.sh and build-cuda-image.sh: the pinned CUDA 13.4 wheels
# (PyPI only) and the stub libraries a cuda build starts against where there is no driver.

# The toolkit the build needs (nvcc, headers, and the runtime and NVRTC libraries).
CUDA_WHEELS=(nvidia-cuda-nvcc==13.4.92 nvidia-cuda-crt==13.4.92 nvidia-nvvm==13.4.92
  nvidia-cuda-runtime==13.4.92 nvidia-cuda-nvrtc==13.4.92 nvidia-cuda-cccl==13.3.5.0.6)
# The libraries a GPU run loads besides the driver: cuBLAS(Lt), cuRAND, NCCL.
CUDA_RUNTIME_WHEELS=(nvidia-cublas==13.4.3.11 nvidia-curand==10.4.4.72 nvidia-nccl-cu13==2.30.7)
# The run-time wheels of the image (runtime and NVRTC come from the toolkit list).
CUDA_IMAGE_WHEELS=(nvidia-cuda-runtime==13.4.92 nvidia-cuda-nvrtc==13.4.92 "${CUDA_RUNTIME_WHEELS[@]}")

# The directory of cudarc's sources in this workspace (its symbol lists make the stubs).
cudarc_dir() { # python
  cargo metadata --format-version 1 --features duet/cuda,duet/nccl | "$1" -c '
import json, os, sys
print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))'
}

# Writes DIR/SONAME: a library exporting every function cudarc's MODULE bindings load, each
# returning RET (an error code of that library), so that a binary linked against the real
# one starts and fails cleanly at its first call. Also links DIR/libNAME.so to it.
cuda_stub() { # cudarc_dir dir name module soname ret
  local cudarc="$1" dir="$2" name="$3" module="$4" soname="$5" ret="$6"
  local c="$dir/stub_$name.c"
  echo "/* stub $soname: every entry point returns $ret (an error of that library) */" >"$c"
  grep -o 'load::<_F>("[A-Za-z0-9_]*")' "$cudarc/src/$module/sys/mod.rs" |
    sed 's/.*("\(.*\)")/\1/' | sort -u | sed "s/.*/long &(void) { return $ret; }/" >>"$c"
  gcc -shared -fPIC -O0 -Wl,-soname,"$soname" -o "$dir/$soname" "$c"
  ln -sf "$soname" "$dir/lib$name.so"
}
