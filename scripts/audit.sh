#!/usr/bin/env bash
# Audits duet's dependency tree with cargo-deny (policy: deny.toml).
#
#   scripts/audit.sh            licenses, bans, sources (offline: from Cargo.lock and the
#                               registry cache), then advisories if the RustSec database
#                               can be fetched; says plainly when it cannot
#   scripts/audit.sh --strict   also fails when the advisories could not be checked
#
# `make lint` (and so CI) runs it. The RustSec advisory database is a git repository on
# GitHub: machines that reach only the package registries cannot fetch it, so there the
# advisories are NOT checked; run this where GitHub is reachable, or point cargo-deny at a
# local copy (`db-path` in deny.toml).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
strict=0
[ "${1:-}" = "--strict" ] && strict=1
say() { echo "audit: $*" >&2; }
if ! cargo deny --version >/dev/null 2>&1; then
  # --debug: unoptimized, it builds in 1m09s here instead of 3m20s (every CI run starts
  # from a fresh machine) and checks this tree in 3 s instead of 1 s.
  say "installing cargo-deny from crates.io (about a minute, once)"
  cargo install cargo-deny --locked --version 0.20.2 --debug
fi
# The offline checks read every crate of Cargo.lock, for every platform (a Windows-only
# dependency too), from the registry cache: a build fetches only this platform's.
cargo fetch --locked --quiet
cargo deny --offline check licenses bans sources
say "licenses, bans, sources: ok"
err="$(mktemp)"
trap 'rm -f "$err"' EXIT
if cargo deny check advisories 2>"$err"; then
  say "advisories: ok"
elif grep -q "failed to fetch advisory database" "$err"; then
  say "advisories: NOT CHECKED: the RustSec database (github.com) is unreachable from here"
  if [ "$strict" = 1 ]; then exit 1; fi
else
  cat "$err" >&2
  exit 1
fi
