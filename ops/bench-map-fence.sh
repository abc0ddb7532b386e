#!/usr/bin/env bash
# What routing by the cluster map costs (issue 17: the map epoch READ every batch carries),
# in one run: one memnode registered in a real etcd, and two computenodes over it, one
# routing by the map (--etcd) and one by the fixed ring (--memnodes), alternating:
#
#   ops/bench-map-fence.sh [--rounds 3] [--requests 1000000] [--transport shm|tcp] [--no-build]
#
# Builds the release binaries with the etcd feature (cargo build --release --features etcd;
# --no-build uses target/release as it is), starts etcd (Debian's etcd-server) on loopback
# ports with a temporary data directory, a 256 MiB memnode (shm socket and tcp, or tcp only
# with --transport tcp), `racekv cluster init`, and the two computenodes. Loads 100,000 keys
# (64-byte values) through each, then runs redis-benchmark `-t get,set -n REQUESTS -c 50
# -P 16 -r 100000 -d 64` against each, alternating (ring, map; map, ring; ...), and prints
# each round, the medians and map / ring as JSON with the machine, date and commit. Stops
# everything by pid at the end. Needs etcd, redis-benchmark (redis-tools), protoc.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
rounds=3
requests=1000000
transport=shm
build=1
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --requests) requests=$2; shift 2 ;;
        --transport) transport=$2; shift 2 ;;
        --no-build) build=0; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "bench-map-fence.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
fail() { echo "bench-map-fence.sh: $*" >&2; exit 1; }
[[ $transport == shm || $transport == tcp ]] || fail "--transport is shm or tcp, not $transport"
command -v etcd > /dev/null || fail "etcd missing (apt-get install etcd-server)"
command -v redis-benchmark > /dev/null || fail "redis-benchmark missing (redis-tools)"
if [[ $build -eq 1 ]]; then (cd "$repo" && cargo build --release --features etcd -q); fi
bin=${CARGO_TARGET_DIR:-$repo/target}/release

work=$(mktemp -d)
pids=()
cleanup() {
    local rc=$?
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Waits for "READY" on the first line a daemon prints to $1.
wait_ready() {
    for _ in $(seq 1 300); do
        if grep -q '^READY' "$1" 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    fail "no READY in $1: $(cat "$1" "$1.err" 2>/dev/null | tail -5)"
}

etcd_port=$(free_port)
peer_port=$(free_port)
etcd --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$peer_port" \
    > "$work/etcd.log" 2>&1 &
pids+=($!)
endpoint="http://127.0.0.1:$etcd_port"
for _ in $(seq 1 100); do
    if "$bin/racekv" cluster status --etcd "$endpoint" --cluster bench > /dev/null 2>&1; then break; fi
    sleep 0.1
done

memnode_tcp=127.0.0.1:$(free_port)
listen=(--listen-tcp "$memnode_tcp")
if [[ $transport == shm ]]; then
    listen+=(--listen-shm "$work/memnode.sock")
    ring_memnode="shm:$work/memnode.sock"
else
    ring_memnode="tcp:$memnode_tcp"
fi
"$bin/racekv-memnode" --region-bytes 256MiB "${listen[@]}" --metrics-addr none \
    --etcd "$endpoint" --cluster bench > "$work/memnode.out" 2> "$work/memnode.out.err" &
pids+=($!)
wait_ready "$work/memnode.out"
"$bin/racekv" cluster init --etcd "$endpoint" --cluster bench > /dev/null

ring_port=$(free_port)
map_port=$(free_port)
start_computenode() { # name port args...
    local name=$1 port=$2
    shift 2
    "$bin/racekv-computenode" --redis-addr "127.0.0.1:$port" --attach-socket none --remote-addr none \
        --metrics-addr none "$@" > "$work/$name.out" 2> "$work/$name.out.err" &
    pids+=($!)
    wait_ready "$work/$name.out"
}
start_computenode ring "$ring_port" --memnodes "$ring_memnode"
start_computenode map "$map_port" --etcd "$endpoint" --cluster bench

bench() { # port -> "get set" requests per second
    redis-benchmark -p "$1" -t get,set -n "$requests" -c 50 -P 16 -r 100000 -d 64 --csv \
        | python3 -c 'import csv, sys; r = {row[0]: float(row[1]) for row in csv.reader(sys.stdin) if row and row[0] in ("GET", "SET")}; print(r["GET"], r["SET"])'
}
for port in "$ring_port" "$map_port"; do
    redis-benchmark -p "$port" -t set -n 100000 -r 100000 -d 64 -P 16 -q > /dev/null
done

results=()
for (( r = 0; r < rounds; r++ )); do
    if (( r % 2 == 0 )); then order=(ring map); else order=(map ring); fi
    for name in "${order[@]}"; do
        port=$ring_port
        [[ $name == map ]] && port=$map_port
        read -r get set < <(bench "$port")
        echo "round $((r + 1)) $name: GET $get/s SET $set/s" >&2
        results+=("$name $get $set")
    done
done

printf '%s\n' "${results[@]}" | python3 -c '
import json, platform, statistics, subprocess, sys, datetime, os
rows = [line.split() for line in sys.stdin if line.strip()]
med = lambda name, i: statistics.median(float(r[i]) for r in rows if r[0] == name)
out = {
    "machine": f"{platform.node()} ({os.cpu_count()} cores)",
    "date": datetime.date.today().isoformat(),
    "commit": subprocess.run(["git", "-C", sys.argv[1], "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "transport": sys.argv[2],
    "command": "redis-benchmark -t get,set -n " + sys.argv[3] + " -c 50 -P 16 -r 100000 -d 64",
    "rounds": [{"router": r[0], "get_per_sec": float(r[1]), "set_per_sec": float(r[2])} for r in rows],
}
for name in ("ring", "map"):
    out[name] = {"get_per_sec": med(name, 1), "set_per_sec": med(name, 2)}
out["map_over_ring"] = {"get": round(out["map"]["get_per_sec"] / out["ring"]["get_per_sec"], 3),
                        "set": round(out["map"]["set_per_sec"] / out["ring"]["set_per_sec"], 3)}
print(json.dumps(out, indent=2))
' "$repo" "$transport" "$requests"
