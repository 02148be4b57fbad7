#!/usr/bin/env bash
# `make cluster-up`: the compose cluster of deploy/compose/ (etcd, a router, 2 prefill and 2
# decode workers, each its own container and address), built from what this project makes:
# the duet image (scripts/build-image.sh) and etcd from Debian's package on the same base,
# nothing pulled. Returns once the router serves and all four workers are registered, and
# prints the router's gRPC and HTTP addresses and Prometheus's. `make cluster-down` removes it all.
# DUET_IMAGE (default duet:latest) and DUET_COMPOSE_PROJECT (default duet) choose the image
# and the project; DUET_BIN is the duet that asks the router (default target/release/duet).
set -euo pipefail
cd "$(dirname "$0")/.."
# Compose v2: the docker plugin where installed, else Debian's docker-compose command.
if docker compose version >/dev/null 2>&1; then dc=(docker compose); else dc=(docker-compose); fi
compose=("${dc[@]}" -p "${DUET_COMPOSE_PROJECT:-duet}" -f deploy/compose/compose.yaml)
t0=$(date +%s)
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || ./scripts/fetch-model.sh
docker image inspect "${DUET_IMAGE:-duet:latest}" >/dev/null 2>&1 || ./scripts/build-image.sh >/dev/null
./scripts/build-base-image.sh >/dev/null
secret=deploy/compose/.secret/kv-secret
if [ ! -s "$secret" ]; then
  mkdir -p "$(dirname "$secret")" && chmod 700 "$(dirname "$secret")"
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$secret"
fi
# The containers run as uid 65532 and read it through a read-only bind mount of the file.
chmod 644 "$secret"
"${compose[@]}" up -d --build --quiet-pull >&2
grpc="127.0.0.1:$("${compose[@]}" port router 50051 | cut -d: -f2)"
http="127.0.0.1:$("${compose[@]}" port router 8000 | cut -d: -f2)"
prom="127.0.0.1:$("${compose[@]}" port prometheus 9090 | cut -d: -f2)"
bin="${DUET_BIN:-target/release/duet}"
[ -x "$bin" ] || cargo build --release -p duet >&2
for _ in $(seq 180); do
  if "$bin" health --target "http://$grpc" >/dev/null 2>&1 &&
    [ "$("$bin" status --router "http://$grpc" 2>/dev/null | grep -c '"role"')" -ge 4 ]; then
    echo "cluster-up: router serves, 4 workers registered ($(( $(date +%s) - t0 )) s)" >&2
    echo "router gRPC: http://$grpc"
    echo "router HTTP: http://$http (OpenAI API under /v1)"
    echo "prometheus: http://$prom"
    exit 0
  fi
  sleep 1
done
"${compose[@]}" ps >&2
"${compose[@]}" logs --tail 20 >&2
echo "cluster-up: the router did not serve 4 workers within 180 s" >&2
exit 1
