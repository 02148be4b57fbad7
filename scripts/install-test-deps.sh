#!/usr/bin/env bash
# Install what `make test` needs on a fresh Debian machine (idempotent).
# The Rust toolchain itself is expected (rustup); everything else comes from
# Debian's packages or PyPI.
set -euo pipefail

need_apt=()
if ! command -v python3 >/dev/null; then
  need_apt+=(python3 python3-pip)
elif ! python3 -m pip --version >/dev/null 2>&1; then
  need_apt+=(python3-pip)
fi
command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
command -v iperf3 >/dev/null || need_apt+=(iperf3)
command -v curl >/dev/null || need_apt+=(curl)
command -v etcd >/dev/null || need_apt+=(etcd-server)
# `ip netns`, veth and bridges: the KV link cut test (cli/tests/fault_network_cut.rs).
command -v ip >/dev/null || need_apt+=(iproute2)
# UCX headers and libraries, found with pkg-config: the rdma feature of kv-transfer
# (kv-transfer/tests/rdma.rs runs it over UCX's tcp and shared-memory transports).
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
{ command -v pkg-config >/dev/null && pkg-config --exists ucx; } || need_apt+=(libucx-dev)
# debootstrap: the container tests build duet's base image from Debian's packages
# (scripts/build-base-image.sh; no registry is reachable). docker-compose: their cluster.
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || need_apt+=(docker-compose)
# Prometheus and promtool: the observability tests scrape a live cluster with them.
command -v promtool >/dev/null && command -v prometheus >/dev/null || need_apt+=(prometheus)

if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-test-deps: need root to apt-get install ${need_apt[*]}" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# Python gRPC client packages for cli/tests/python_client.rs (stubs generated from proto/
# with grpcio-tools; health checked with grpcio-health-checking; reflection read with
# grpcio-reflection, which speaks v1alpha only). Pinned together: the five
# are released in lockstep and grpcio-tools 1.85 needs protobuf 7.x. A Debian python3 is
# "externally managed": PIP_BREAK_SYSTEM_PACKAGES lets pip install there (older pips ignore it).
# The official `openai` package drives the OpenAI-compatible door (cli/tests/openai_http.rs).
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check \
  'grpcio==1.85.1' 'grpcio-tools==1.85.1' 'grpcio-health-checking==1.85.1' \
  'grpcio-reflection==1.85.1' 'protobuf==7.36.2' \
  'openai==3.57.0'
python3 -c 'import grpc, grpc_tools.protoc, grpc_health.v1.health_pb2, grpc_reflection.v1alpha.reflection, openai' \
  || { echo "install-test-deps: the Python gRPC / openai packages do not import" >&2; exit 1; }
command -v cargo >/dev/null || { echo "install-test-deps: cargo not found (install Rust with rustup)" >&2; exit 1; }
echo "install-test-deps: ok"
