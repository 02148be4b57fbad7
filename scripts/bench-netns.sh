#!/usr/bin/env bash
# What a slower network between prefill and decode does to time-to-first-token.
# Run by hand as root (not in CI); results in docs/benchmarks.md.
#
# Topology: a bridge in the root namespace (etcd and the router live there), and one
# network namespace per worker, each its own "host" with its own address:
#   duet-p (10.77.0.2): duet prefill, pinned to core 0, 1 thread
#   duet-d (10.77.0.3): duet decode,  pinned to core 1, 1 thread
# The prefill host's egress (its KV going to the decode host) is rate-limited with
# `tc ... tbf` to each rate of NETS ("none" = no limit: veth, ~11 Gbit/s here).
# For each rate: PROMPTS long prompts one at a time (`duet generate --json`, which reports
# the KV bytes, the streaming time and the exposed transfer time), median reported.
#
# Environment: NETS ["none 10gbit 1gbit"], PROMPTS [5], CHARS prompt length in characters
# [4500: about 1000 tokens], KV_DTYPE [f32], KV_COMPRESSION of the prefill worker's KV on
# the wire [none; f16, int8], OUT [bench/results/netns-<date>.json]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
NETS="${NETS:-none 10gbit 1gbit}"
PROMPTS="${PROMPTS:-5}"
CHARS="${CHARS:-4500}"
KV_DTYPE="${KV_DTYPE:-f32}"
KV_COMPRESSION="${KV_COMPRESSION:-none}"
OUT="${OUT:-$root/bench/results/netns-$(date +%F).json}"
say() { echo "bench-netns: $*" >&2; }
die() { say "$*"; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (network namespaces, tc)"
command -v tc >/dev/null && command -v ip >/dev/null || die "needs iproute2 (ip, tc)"
command -v etcd >/dev/null || die "needs etcd (apt-get install etcd-server)"

./scripts/fetch-model.sh >/dev/null
cargo build --release -p duet
duet="${CARGO_TARGET_DIR:-$root/target}/release/duet"
# Separate duet processes refuse to start without the cluster secret: one for this run.
export DUET_KV_SECRET_FILE="$(mktemp)"
head -c 32 /dev/urandom | base64 > "$DUET_KV_SECRET_FILE"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
work="$(mktemp -d /tmp/duet-netns.XXXXXX)"
pids=()

cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  ip netns del duet-p 2>/dev/null || true
  ip netns del duet-d 2>/dev/null || true
  ip link del br-duet 2>/dev/null || true
  while iptables -D FORWARD -i br-duet -o br-duet -j ACCEPT 2>/dev/null; do :; done
  rm -rf "$work"
}
trap cleanup EXIT
cleanup_links() { ip netns del duet-p 2>/dev/null || true; ip netns del duet-d 2>/dev/null || true; ip link del br-duet 2>/dev/null || true; }
cleanup_links

ip link add br-duet type bridge
ip addr add 10.77.0.1/24 dev br-duet
ip link set br-duet up
# Host to host across the bridge is forwarded: where Docker runs, FORWARD drops it.
if command -v iptables >/dev/null; then iptables -I FORWARD -i br-duet -o br-duet -j ACCEPT; fi
i=2
for ns in p d; do
  ip netns add "duet-$ns"
  ip link add "veth-$ns" type veth peer name eth0 netns "duet-$ns"
  ip link set "veth-$ns" master br-duet up
  ip -n "duet-$ns" addr add "10.77.0.$i/24" dev eth0
  ip -n "duet-$ns" link set eth0 up
  ip -n "duet-$ns" link set lo up
  i=$((i + 1))
done

etcd --name netns --data-dir "$work/etcd" \
  --listen-client-urls http://10.77.0.1:23791 --advertise-client-urls http://10.77.0.1:23791 \
  --listen-peer-urls http://127.0.0.1:23792 --initial-advertise-peer-urls http://127.0.0.1:23792 \
  --initial-cluster netns=http://127.0.0.1:23792 >"$work/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  curl -sf http://10.77.0.1:23791/health >/dev/null && break
  sleep 0.1
done
ETCD=http://10.77.0.1:23791
# --prefix-cache off: the prompts repeat, and a cache hit would hide the transfer measured.
common=(--etcd "$ETCD" --cluster netns --model "$model" --threads 1 --kv-pool 512MiB --kv-dtype "$KV_DTYPE"
  --prefix-cache off)
ip netns exec duet-d taskset -c 1 "$duet" decode "${common[@]}" --id decode-0 \
  --listen 10.77.0.3:7002 --kv-listen 10.77.0.3:7003 --metrics-listen 10.77.0.3:0 \
  >"$work/decode.log" 2>&1 &
pids+=($!)
ip netns exec duet-p taskset -c 0 "$duet" prefill "${common[@]}" --id prefill-0 \
  --listen 10.77.0.2:7001 --metrics-listen 10.77.0.2:0 --kv-compression "$KV_COMPRESSION" \
  >"$work/prefill.log" 2>&1 &
pids+=($!)
"$duet" router --etcd "$ETCD" --cluster netns --model "$model" --listen 10.77.0.1:7000 \
  --local-prefill-max-tokens 0 >"$work/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 600); do
  grep -q "serving gRPC" "$work/decode.log" && grep -q "serving gRPC" "$work/prefill.log" \
    && grep -q "router listening" "$work/router.log" && break
  sleep 0.1
done
sleep 2 # the router's view lists both workers

prompt="$(head -c "$CHARS" bench/data/persuasion-vol1.txt | tr '\n' ' ')"
results="[]"
for net in $NETS; do
  ip netns exec duet-p tc qdisc del dev eth0 root 2>/dev/null || true
  if [ "$net" != none ]; then
    # burst: small next to one layer's KV (1.6 MB at 1000 tokens, f32), so a layer cannot
    # pass in one burst at line rate; iperf3 below reports the rate actually achieved.
    case "$net" in
      10gbit) burst=1mb ;;
      *) burst=128kb ;;
    esac
    ip netns exec duet-p tc qdisc add dev eth0 root tbf rate "$net" burst "$burst" latency 200ms
  fi
  achieved=""
  if command -v iperf3 >/dev/null; then
    ip netns exec duet-d iperf3 -s -1 -B 10.77.0.3 -p 5299 >/dev/null 2>&1 &
    sleep 0.5
    achieved="$(ip netns exec duet-p iperf3 -c 10.77.0.3 -p 5299 -t 2 -J 2>/dev/null \
      | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9, 2))' || true)"
  fi
  say "network $net (iperf3: ${achieved:-?} Gbit/s)"
  "$duet" generate --router http://10.77.0.1:7000 --prompt "$prompt" --max-tokens 4 --json >/dev/null # warm-up
  runs="[]"
  for _ in $(seq "$PROMPTS"); do
    r="$("$duet" generate --router http://10.77.0.1:7000 --prompt "$prompt" --max-tokens 4 --json)"
    runs="$(python3 -c 'import json,sys; a=json.loads(sys.argv[1]); a.append(json.loads(sys.argv[2])); print(json.dumps(a))' "$runs" "$r")"
  done
  results="$(python3 - "$results" "$runs" "$net" "$achieved" "$KV_COMPRESSION" <<'PY'
import json, statistics, sys
results, runs, net = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
achieved = float(sys.argv[4]) if sys.argv[4] else None
t = [r["timings"] for r in runs]
med = lambda k: statistics.median(x.get(k, 0.0) for x in t)
results.append({
    "network": net,
    "kv_compression": sys.argv[5],
    "iperf3_gbit_s": achieved,
    "prompt_tokens": runs[0]["usage"]["prompt_tokens"],
    "kv_bytes": t[0].get("kv_bytes", 0),
    "ttft_s": med("time_to_first_token_seconds"),
    "prefill_s": med("prefill_seconds"),
    "kv_stream_s": med("kv_stream_seconds"),
    "kv_transfer_exposed_s": med("kv_transfer_seconds"),
    "runs": len(runs),
})
print(json.dumps(results))
PY
)"
done
mkdir -p "$(dirname "$OUT")"
echo "$results" | python3 -m json.tool >"$OUT"
python3 - "$OUT" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
base = rows[0]["ttft_s"]
print("| network | compression | iperf3 Gbit/s | prompt tokens | KV MB | TTFT s | vs %s | KV streaming s | exposed transfer ms |" % rows[0]["network"])
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| %s | %s | %s | %d | %.1f | %.3f | %.2fx | %.3f | %.1f |" % (r["network"], r["kv_compression"], r["iperf3_gbit_s"], r["prompt_tokens"], r["kv_bytes"] / 1e6, r["ttft_s"], r["ttft_s"] / base, r["kv_stream_s"], 1000 * r["kv_transfer_exposed_s"]))
PY
say "results in $OUT"
