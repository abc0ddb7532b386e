#!/usr/bin/env bash
# Replicated SETs by the snapshot protocol against one-key transactions, same binaries, same
# cluster: one `racekv up --memnodes 3 --replicas R --tcp-only` (release build with etcd, in
# target/release), 100,000 keys loaded, then for each round `racekv cluster
# set-snapshot-writes on` and `off` in turn while it serves, and after each switch
# redis-benchmark `-t set -n REQUESTS -c 1 -r 100000 -d 64` (one client: a SET's latency).
# Prints each run's CSV line (requests/s, avg, min, p50, p95, p99, max in ms).
#
#   ops/bench-snapshot-ab.sh [ROUNDS=3] [REQUESTS=10000] [R=3]
#
# Needs etcd (etcd-server), redis-benchmark (redis-tools); build first with
# `cargo build --release --features etcd -p racekv -p racekv-memnode`.
set -euo pipefail
rounds=${1:-3} requests=${2:-10000} replicas=${3:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/target/release/racekv
[[ -x $bin && -x $root/target/release/racekv-memnode ]] || { sed -n '2,13p' "$0"; exit 2; }
work=$(mktemp -d)
cleanup() {
    [[ -n ${pid:-} ]] && kill -INT "$pid" 2>/dev/null && sleep 3
    [[ -n ${pid:-} ]] && kill -KILL -- -"$pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
(cd "$work" && XDG_RUNTIME_DIR=$work RACEKV_LOG=warn exec setsid "$bin" up --memnodes 3 --replicas "$replicas" \
    --etcd-port 19100 --base-port 19110 --redis-port 19120 --remote-port 19121 --metrics-addr none \
    --region-bytes 256MiB --tcp-only > "$work/up.log" 2>&1) &
pid=$!
for _ in $(seq 1 600); do grep -q "Ctrl-C stops the cluster" "$work/up.log" && break; sleep 0.1; done
grep -q "Ctrl-C stops the cluster" "$work/up.log" || { tail -5 "$work/up.log" >&2; exit 1; }
redis-benchmark -p 19120 -t set -n 100000 -c 50 -P 16 -r 100000 -d 64 -q > /dev/null
for round in $(seq 1 "$rounds"); do
    for mode in on off; do
        RACEKV_LOG=warn "$bin" cluster set-snapshot-writes --etcd http://127.0.0.1:19100 "$mode" > /dev/null
        sleep 1 # the computenode installs the map
        echo "round $round, snapshot writes $mode: $(redis-benchmark -p 19120 -t set -n "$requests" -c 1 \
            -r 100000 -d 64 --csv 2>/dev/null | tail -1)"
    done
done
