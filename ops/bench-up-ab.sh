#!/usr/bin/env bash
# A/B of two racekv binaries as users run them: each side a `racekv up` of its own (one
# memnode over shm, the defaults, 1 GiB region), then redis-benchmark (-c 50 -P 16
# -r 200000 -d 64, TEST = set or get) against each, alternating A, B; B, A; ... Prints each
# run's requests/s and the geometric mean of the rounds' B / A ratios (each round's two runs
# are back to back: the estimate this host's drift disturbs least).
#
#   ops/bench-up-ab.sh A_RACEKV B_RACEKV [ROUNDS=6] [REQUESTS=2000000] [TEST=set]
#
# Environment: CLIENTS (50) and PIPELINE (16) for redis-benchmark's -c and -P; UP_ARGS, more
# `racekv up` flags for both sides (e.g. "--memnodes 3 --replicas 3 --tcp-only": each side
# then runs its own etcd, and each racekv runs the racekv-memnode beside it). Needs
# redis-benchmark and redis-cli.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,10p' "$0"; exit 2; }
a_bin=$(realpath "$1") b_bin=$(realpath "$2") rounds=${3:-6} requests=${4:-2000000} test=${5:-set}
clients=${CLIENTS:-50} pipeline=${PIPELINE:-16}
read -r -a up_args <<< "${UP_ARGS:-}"
for tool in redis-benchmark redis-cli; do
    command -v "$tool" > /dev/null || { echo "bench-up-ab.sh: $tool missing" >&2; exit 1; }
done
for bin in "$a_bin" "$b_bin"; do [[ -x $bin ]] || { echo "bench-up-ab.sh: no $bin" >&2; exit 1; }; done
# shellcheck source=ops/lib.sh
source "$(dirname "$0")/lib.sh"
racekv_work_dir
declare -A bin=([A]=$a_bin [B]=$b_bin) port=([A]=16601 [B]=16602) base=([A]=17900 [B]=17920)
for side in A B; do
    mkdir -p "$work/$side"
    (cd "$work/$side" && XDG_RUNTIME_DIR=$work/$side exec "${bin[$side]}" up --region-bytes 1GiB \
        --base-port "${base[$side]}" --redis-port "${port[$side]}" --remote-port $(( ${base[$side]} + 10 )) \
        --etcd-port $(( ${base[$side]} + 12 )) --metrics-addr none "${up_args[@]}" > up.out 2> up.err) &
    pids+=($!)
done
for side in A B; do
    for (( t = 0; t < 600; t++ )); do redis-cli -p "${port[$side]}" ping 2> /dev/null | grep -q PONG && break; sleep 0.1; done
    redis-cli -p "${port[$side]}" ping | grep -q PONG || { echo "side $side not up: $(tail -3 "$work/$side/up.err")" >&2; exit 1; }
    # The same keys in both, so GETs find them and SETs update.
    redis-benchmark -p "${port[$side]}" -t set -n 400000 -c 50 -P 16 -r 200000 -d 64 -q > /dev/null
done
run() { # run SIDE: requests/s
    redis-benchmark -p "${port[$1]}" --csv -t "$test" -n "$requests" -c "$clients" -P "$pipeline" -r 200000 -d 64 2>/dev/null \
        | awk -F'"' 'NR == 2 {print $4 " '"$test"'/s"}'
}
racekv_ab_rounds "$rounds" run
