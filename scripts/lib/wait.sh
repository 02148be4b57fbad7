# Sourced by the scripts that start duet and measure it (bench-serve.sh, bench-prefix.sh,
# validate-plan.sh): waiting for a duet process to come up. The sourcing script defines
# die() and sets $duet, the duet binary.

# Waits until `file` has a line matching `pattern`; prints the first URL on it.
wait_line() { # file pattern
  for _ in $(seq 1200); do
    if grep -q "$2" "$1" 2>/dev/null; then
      grep -m1 "$2" "$1" | grep -o 'http://[0-9.:]*' | head -1
      return 0
    fi
    sleep 0.1
  done
  die "no line matching '$2' in $1 after 120 s (see the log)"
}

# Waits until the duet router at $1 answers a one-token request.
wait_duet() { # url
  for _ in $(seq 240); do
    "$duet" generate --router "$1" --prompt "Hello" --max-tokens 1 --json >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  die "duet at $1 never answered"
}
