# duet's CUDA image, built by `make image-cuda` (scripts/build-cuda-image.sh) with nothing
# pulled: the same Debian base as deploy/docker/Dockerfile, the binary built with the `cuda`
# and `nccl` features (scripts/build-cuda.sh), and the CUDA 13.4 user-space libraries it
# loads (cudart, NVRTC, cuBLAS/cuBLASLt, cuRAND, NCCL) from NVIDIA's PyPI wheels. No driver:
# the node provides libcuda.so.1 (the NVIDIA container toolkit mounts it into
# /usr/lib/x86_64-linux-gnu and refreshes the loader's cache).
#
# A stub libcuda.so.1 (every call fails with CUDA_ERROR_STUB_LIBRARY) sits in a directory the
# loader searches last (zz-*.conf sorts after Debian's x86_64-linux-gnu.conf), so that on a
# node without a driver the binary still starts: `--device cpu` serves and `--device cuda`
# is refused at start with exit code 2 naming libcuda.so.1. Where the node's driver is
# mounted, it is found first (checked by the build script).
#
# Build context (staged by the script, target/image-cuda/): duet, cuda/ (the libraries),
# driver-stub/ (libcuda.so.1), licenses/.

ARG BASE_IMAGE=duet-base:bookworm-2
FROM ${BASE_IMAGE}
ARG VERSION=unknown
ARG COMMIT=unknown
COPY cuda/ /usr/local/lib/duet-cuda/
COPY driver-stub/ /usr/local/lib/duet-cuda-driver-stub/
RUN echo /usr/local/lib/duet-cuda >/etc/ld.so.conf.d/duet-cuda.conf \
 && echo /usr/local/lib/duet-cuda-driver-stub >/etc/ld.so.conf.d/zz-duet-cuda-driver-stub.conf \
 && ldconfig
COPY duet /usr/local/bin/duet
COPY licenses/ /usr/share/licenses/duet/
LABEL org.opencontainers.image.title="duet (CUDA)" \
      org.opencontainers.image.description="duet: disaggregated prefill/decode LLM serving, built with CUDA (candle engine on --device cuda:N, KV over NCCL)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}" \
      org.opencontainers.image.licenses="Apache-2.0 AND LicenseRef-NVIDIA-CUDA AND BSD-3-Clause" \
      org.opencontainers.image.base.name="duet-base:bookworm-2"
# What the NVIDIA container toolkit reads: every GPU the runtime was given, compute only.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DUET_MODEL=/models/SmolLM2-135M-Instruct.Q4_1.gguf
EXPOSE 50051 8000 9400 50070
USER 65532:65532
WORKDIR /tmp
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/duet", "health", "--timeout", "3s"]
ENTRYPOINT ["/usr/local/bin/duet"]
CMD ["--help"]
