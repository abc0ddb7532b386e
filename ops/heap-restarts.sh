#!/bin/bash
# Heap use across computenode restarts: a memnode (256 MiB, memfd) stays up while a
# computenode is started, loaded with SETs by redis-benchmark, and stopped, CYCLES times.
# Prints the memnode's heap gauges while each computenode runs and after it stopped; the
# heap top (used + free) should stop growing after the first cycle. Needs a release build
# (cargo build --release; RACEKV_BIN=dir picks other binaries) and redis-benchmark.
# Usage: ops/heap-restarts.sh [CYCLES] [KEYS]
set -euo pipefail
CYCLES=${1:-8}
KEYS=${2:-100000}
BIN=${RACEKV_BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release}
DIR=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$DIR"' EXIT
"$BIN/racekv-memnode" --region-bytes 268435456 --listen-shm "$DIR/m.sock" --listen-tcp 127.0.0.1:0 \
    --token heap --metrics-addr 127.0.0.1:9791 > "$DIR/memnode.log" 2>&1 &
sleep 1
gauges() {
    sleep 1.2 # the memnode refreshes its gauges every second
    curl -s 127.0.0.1:9791/metrics | awk '
        /^racekv_memnode_heap_used_bytes[{ ]/ {u=$2} /^racekv_memnode_heap_free_bytes[{ ]/ {f=$2}
        /^racekv_memnode_heap_fragment_bytes[{ ]/ {g=$2} /^racekv_memnode_items[{ ]/ {n=$2}
        END {printf "keys %7d  used %6.1f MiB  free %6.1f MiB (fragments %5.1f)  top %6.1f MiB\n", n, u/1048576, f/1048576, g/1048576, (u+f)/1048576}'
}
for cycle in $(seq 1 "$CYCLES"); do
    "$BIN/racekv-computenode" --memnodes "shm:$DIR/m.sock" --token heap --redis-addr 127.0.0.1:6791 \
        --attach-socket "$DIR/c.sock" > "$DIR/computenode.log" 2>&1 &
    cn=$!
    sleep 1.5
    redis-benchmark -p 6791 -t set -r "$KEYS" -n $((3 * KEYS)) -d 1000 -P 16 -q > /dev/null
    printf "cycle %d running: " "$cycle"; gauges
    kill -INT "$cn"; wait "$cn" || true
    printf "cycle %d stopped: " "$cycle"; gauges
done
