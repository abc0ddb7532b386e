#!/usr/bin/env bash
# A/B of two computenode binaries over tcp: each attached to two memnodes of its own (loopback
# tcp, a token; A_MEMNODE and B_MEMNODE name each side's memnode binary, both
# target/release/racekv-memnode by default), the same 100,000 keys (64-byte values) loaded into
# each, then redis-benchmark
# (-c 50 -P 16 -r 100000 -d 64, TEST = get or set) against each, alternating A, B; B, A; ...
# Prints each run's requests/s and the machine's context switches per request (perf stat
# -a: every process, so both sides of each round trip count), then the geometric mean of
# the rounds' B / A throughput ratios. For changes whose gain this host's noise hides in
# throughput alone (the per-request context switches move far less from run to run).
#
#   ops/bench-tcp-ab.sh A_COMPUTENODE B_COMPUTENODE [ROUNDS=6] [REQUESTS=400000] [TEST=get]
#
# CLIENTS and PIPELINE (environment) change -c and -P (CLIENTS=1 PIPELINE=1: one request's
# latency alone).
#
# cargo build --release first, for the default memnode. Needs
# redis-benchmark, redis-cli and perf.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,17p' "$0"; exit 2; }
a_bin=$1 b_bin=$2 rounds=${3:-6} requests=${4:-400000} test=${5:-get}
repo=$(cd "$(dirname "$0")/.." && pwd)
memnode=${CARGO_TARGET_DIR:-$repo/target}/release/racekv-memnode
declare -A memnode_bin=([A]=${A_MEMNODE:-$memnode} [B]=${B_MEMNODE:-$memnode})
for tool in redis-benchmark redis-cli perf; do
    command -v "$tool" > /dev/null || { echo "bench-tcp-ab.sh: $tool missing" >&2; exit 1; }
done
for bin in "${memnode_bin[A]}" "${memnode_bin[B]}" "$a_bin" "$b_bin"; do [[ -x $bin ]] || { echo "bench-tcp-ab.sh: no $bin" >&2; exit 1; }; done
# shellcheck source=ops/lib.sh
source "$(dirname "$0")/lib.sh"
racekv_work_dir
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/token"
declare -A port=([A]=16501 [B]=16502) memnode_port=([A]=17800 [B]=17810)
for side in A B; do
    memnodes=()
    for i in 0 1; do
        listen=127.0.0.1:$(( ${memnode_port[$side]} + i ))
        RACEKV_MEMNODE_TOKEN_FILE=$work/token "${memnode_bin[$side]}" --listen-tcp "$listen" --metrics-addr none \
            --region-bytes 256MiB > "$work/memnode-$side$i.out" 2> "$work/memnode-$side$i.err" &
        pids+=($!)
        memnodes+=("tcp:$listen")
    done
    for i in 0 1; do
        for (( t = 0; t < 100; t++ )); do grep -qs '^READY' "$work/memnode-$side$i.out" && break; sleep 0.1; done
    done
    bin=$a_bin
    [[ $side == B ]] && bin=$b_bin
    mkdir -p "$work/$side"
    RACEKV_COMPUTENODE_TOKEN_FILE=$work/token RACEKV_COMPUTENODE_MEMNODES=$(IFS=,; echo "${memnodes[*]}") \
        XDG_RUNTIME_DIR=$work/$side "$bin" --redis-addr "127.0.0.1:${port[$side]}" --remote-addr none \
        --metrics-addr none > "$work/$side.out" 2> "$work/$side.err" &
    pids+=($!)
done
for side in A B; do
    for (( t = 0; t < 100; t++ )); do grep -qs '^READY' "$work/$side.out" && break; sleep 0.1; done
    grep -q '^READY' "$work/$side.out" || { echo "computenode $side not ready: $(tail -3 "$work/$side.err")" >&2; exit 1; }
    awk 'BEGIN {
        v = sprintf("%064d", 0); gsub(/0/, "x", v)
        for (i = 0; i < 100000; i++) { k = sprintf("key:%012d", i); printf "*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$64\r\n%s\r\n", length(k), k, v }
    }' | redis-cli -p "${port[$side]}" --pipe > /dev/null
done

run() { # run SIDE: prints "requests/s context-switches/request"
    local rps
    rps=$(perf stat -a -e context-switches -x, -o "$work/cs.txt" -- redis-benchmark -p "${port[$1]}" --csv \
        -t "$test" -n "$requests" -c "${CLIENTS:-50}" -P "${PIPELINE:-16}" -r 100000 -d 64 2>/dev/null \
        | awk -F'"' 'NR == 2 {print $4}')
    awk -F, -v rps="$rps" -v n="$requests" -v t="$test" '/context-switches/ {printf "%s %s/s, %.2f context switches/request", rps, t, $1 / n}' "$work/cs.txt"
}
racekv_ab_rounds "$rounds" run
