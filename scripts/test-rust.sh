#!/usr/bin/env bash
# The workspace's Rust tests (what `make test` runs first): every test binary built once, as
# `cargo test --workspace` builds them, then run DUET_TEST_LANES at a time (default 2), the
# longest first, then the doc tests.
#
# Why lanes: `cargo test` runs one test binary after another, and a binary often waits (a
# worker frozen past --kv-timeout, a lease expiring, a container restarting, one last long
# test alone) instead of computing. Measured 2026-12-07 on a 2-core machine: one at a time,
# the binaries took 1,854 s and kept 1.4 of the 2 cores busy (2,548 CPU-seconds, from
# /proc/stat); two at a time, the whole suite took 1,344 s, doc tests included. Within a
# binary, tests still run as `cargo test` runs them (libtest's threads), so nothing a test
# relies on changes; the binaries were already written to share the machine (free ports,
# their own etcd and cluster names, their own network namespaces).
#
# Output: each binary's whole output, printed when it ends, under a `==> crate/binary` line
# (its `test result:` lines are what .ci/run totals), then one line per binary with its wall
# time, then the failed binaries, if any. Exit status 1 if any binary or the doc tests failed.
#
# Order: scripts/test-durations.txt (seconds per binary, measured; unknown binaries count 30 s)
# so that the long ones start first and the lanes end together.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# One build with the rdma feature on (UCX over tcp and shared memory here): its tests are the
# default build's plus the rdma ones, and a second build just for them would recompile every
# crate above kv-transfer. fault-injection adds the test-only fault plans of the KV sender
# (DUET_KV_FAULTS); release builds (make up) never have it.
features="${DUET_TEST_FEATURES:-duet/rdma,duet/fault-injection}"
lanes="${DUET_TEST_LANES:-2}"
cargo="${CARGO:-cargo}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Build every test binary (what `cargo test --workspace` would build) and queue them, one
# line each: name (crate/binary), executable, package directory; the longest first.
"$cargo" test --workspace --no-run --features "$features" --message-format=json-render-diagnostics \
  > "$work/build.json"
python3 - "$work/build.json" "$root/scripts/test-durations.txt" > "$work/queue" <<'PY'
import json, sys
durations = {}
for line in open(sys.argv[2]):
    parts = line.split("#")[0].split()
    if len(parts) == 2:
        durations[parts[0]] = float(parts[1])
bins = []
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("profile", {}).get("test"):
        continue
    exe = m.get("executable")
    if not exe:
        continue
    pkg_dir = m["manifest_path"].rsplit("/", 1)[0]
    name = pkg_dir.rsplit("/", 1)[1] + "/" + m["target"]["name"]
    if m["target"]["kind"][0] == "lib":
        name += "(lib)"
    bins.append((durations.get(name, 30.0), name, exe, pkg_dir))
for d, name, exe, pkg_dir in sorted(bins, key=lambda b: -b[0]):
    print(name, exe, pkg_dir)
PY
echo "test-rust: $(wc -l < "$work/queue") test binaries, $lanes at a time"

# One binary: cwd and CARGO_MANIFEST_DIR as cargo test sets them; output to a file, printed
# whole when it ends (flock keeps two binaries' outputs apart).
run_one() {
  local name="$1" exe="$2" dir="$3" log t0 status
  log="$work/$(echo "$name" | tr '/()' '___').log"
  t0=$(date +%s)
  set +e
  (cd "$dir" && CARGO_MANIFEST_DIR="$dir" "$exe" > "$log" 2>&1)
  status=$?
  set -e
  local secs=$(( $(date +%s) - t0 ))
  {
    flock 9
    echo "==> $name ($secs s, exit $status)"
    cat "$log"
    echo "$name $secs $status" >> "$work/times"
  } 9> "$work/print.lock"
}
export -f run_one
export work

# One queue line per call: its three words are run_one's arguments.
xargs -P "$lanes" -L 1 bash -c 'run_one "$@"' _ < "$work/queue" || true

set +e
"$cargo" test --workspace --doc --features "$features"
doc_status=$?
set -e

echo
echo "test-rust: wall time per binary (s, exit status), longest first:"
sort -k2 -n -r "$work/times" | awk '{printf "  %-40s %5d s  exit %d\n", $1, $2, $3}'
failed="$(awk '$3 != 0 {print $1}' "$work/times")"
if [ -n "$failed" ] || [ "$doc_status" -ne 0 ]; then
  echo "test-rust: FAILED: ${failed//$'\n'/ } $([ "$doc_status" -ne 0 ] && echo doc-tests)"
  exit 1
fi
echo "test-rust: every binary passed"
