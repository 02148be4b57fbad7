#!/usr/bin/env bash
# Install what `make test` needs on a fresh Debian machine (idempotent).
# The Rust toolchain itself is expected (rustup); everything else comes from
# Debian's packages or PyPI.
set -euo pipefail

need_apt=()
command -v python3 >/dev/null || need_apt+=(python3 python3-pip)
command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
command -v iperf3 >/dev/null || need_apt+=(iperf3)
command -v etcd >/dev/null || need_apt+=(etcd-server)

if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-test-deps: need root to apt-get install ${need_apt[*]}" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "install-test-deps: cargo not found (install Rust with rustup)" >&2; exit 1; }
echo "install-test-deps: ok"
