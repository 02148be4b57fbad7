#!/usr/bin/env bash
# duet-base:bookworm-2, the base of duet's image, made here from Debian's packages: no registry
# is reachable from these machines, so nothing is pulled. debootstrap (minbase: dpkg, apt,
# coreutils, bash) plus ca-certificates and libucx0 (UCX, which a build with the `rdma`
# feature links: the tests' build), then `docker import`. Idempotent: an existing image is
# kept unless REBUILD=1; the tag's revision (-2) changes with the package list. Needs root
# (debootstrap) and a Docker engine.
set -euo pipefail
TAG="${BASE_IMAGE:-duet-base:bookworm-2}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if [ "${REBUILD:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "build-base-image: $TAG exists"
  exit 0
fi
command -v debootstrap >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
}
root="$(mktemp -d /tmp/duet-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT
t0=$(date +%s)
debootstrap --variant=minbase --include=ca-certificates,libucx0 bookworm "$root" "$MIRROR" >/dev/null
# Nothing an image needs at run time: package lists, caches, documentation.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar --numeric-owner -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "build-base-image: $TAG from $MIRROR in $(( $(date +%s) - t0 )) s, $(docker image inspect -f '{{.Size}}' "$TAG") bytes"
