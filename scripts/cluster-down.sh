#!/usr/bin/env bash
# `make cluster-down`: stops the compose cluster and removes its containers and networks
# (the images and the secret file stay, for the next cluster-up).
set -euo pipefail
cd "$(dirname "$0")/.."
# Compose v2: the docker plugin where installed, else Debian's docker-compose command.
if docker compose version >/dev/null 2>&1; then dc=(docker compose); else dc=(docker-compose); fi
"${dc[@]}" -p "${DUET_COMPOSE_PROJECT:-duet}" -f deploy/compose/compose.yaml down --remove-orphans --timeout 15
