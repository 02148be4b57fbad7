#!/usr/bin/env bash
# Runs duet's cargo-fuzz targets for a set time each (outside CI), then turns every crash
# or hang found into a regression input that `make test` replays.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 300 s, every target)
#
# Targets (fuzz/fuzz_targets/): kv_frames (the KV link's frame decoder), openai_request
# (the HTTP door's header and JSON body reading). Invariants live in the crates
# (duet_kv_transfer::fuzzing, duet_router::http::fuzzing), so the regression tests check
# exactly what the fuzzer checks.
#
# Corpus: target/fuzz-corpus/<target>, seeded from fuzz/seeds/<target> (kept between runs,
# not committed). Findings: copied to fuzz/regressions/<target>/ (commit them; the tests
# kv-transfer/tests/fuzz_regressions.rs and router/tests/fuzz_regressions.rs replay them).
# Needs cargo-fuzz (installed from crates.io if missing) and a nightly toolchain, or the
# stable one with RUSTC_BOOTSTRAP=1 (libFuzzer's flags are nightly-only).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
secs="${1:-300}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(kv_frames openai_request)
say() { echo "fuzz: $*" >&2; }

if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  tc=(+nightly)
else
  say "no nightly toolchain: using stable with RUSTC_BOOTSTRAP=1"
  tc=()
  export RUSTC_BOOTSTRAP=1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  say "installing cargo-fuzz from crates.io"
  cargo install cargo-fuzz --locked
fi

found=0
for t in "${targets[@]}"; do
  corpus="$root/target/fuzz-corpus/$t"
  mkdir -p "$corpus" "fuzz/regressions/$t"
  cp -n fuzz/seeds/"$t"/* "$corpus"/ 2>/dev/null || true
  artifacts="$root/target/fuzz-artifacts/$t/"
  rm -rf "$artifacts" && mkdir -p "$artifacts"
  say "$t for ${secs}s (corpus $(ls "$corpus" | wc -l) inputs)"
  set +e
  cargo ${tc[@]+"${tc[@]}"} fuzz run --fuzz-dir fuzz "$t" "$corpus" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$artifacts" -print_final_stats=1 2>&1 | tail -n 25
  rc=${PIPESTATUS[0]}
  set -e
  here=0
  for f in "$artifacts"*; do
    [ -f "$f" ] || continue
    cp "$f" "fuzz/regressions/$t/"
    say "finding: fuzz/regressions/$t/$(basename "$f")"
    here=$((here + 1))
  done
  found=$((found + here))
  if [ "$rc" -ne 0 ] && [ "$here" -eq 0 ]; then
    say "$t: cargo fuzz exited with $rc and left no artifact"
    exit "$rc"
  fi
done
if [ "$found" -gt 0 ]; then
  say "$found finding(s) copied to fuzz/regressions/: fix them, then commit the inputs"
  exit 1
fi
say "no findings"
