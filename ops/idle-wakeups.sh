#!/usr/bin/env bash
# How often an idle racekv wakes up: context switches per second of every thread, over
# 10 s with no load, for (1) `racekv up` (memnode and computenode in one process, shm) and
# (2) a memnode serving tcp with a computenode connected to it (separate processes).
#
#   bash ops/idle-wakeups.sh [DIR]    DIR holds racekv, racekv-memnode, racekv-computenode
#                                     (default target/release; build with cargo build --release)
#
# Ports 7611-7614 and 7711-7712 on 127.0.0.1 must be free.
set -euo pipefail
bin=${1:-target/release}
bin=$(cd "$bin" && pwd)
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"' EXIT

# One line per thread: tid, name, voluntary + involuntary context switches so far.
snapshot() {
    for task in /proc/"$1"/task/*; do
        printf '%s %s %s\n' "${task##*/}" "$(tr ' ' _ < "$task/comm")" \
            "$(awk '/ctxt_switches/ { s += $2 } END { print s }' "$task/status")"
    done | sort
}

# Prints wake-ups per second per thread name (threads of one name summed), then the total.
measure() {
    local pid=$1 label=$2
    snapshot "$pid" > "$work/$pid.before"
    sleep 10
    snapshot "$pid" > "$work/$pid.after"
    echo "== $label (pid $pid, $(ls /proc/"$pid"/task | wc -l) threads): wake-ups per second"
    join "$work/$pid.before" "$work/$pid.after" | awk '{ n[$2] += ($5 - $3) / 10; c[$2]++; t += ($5 - $3) / 10 }
        END { for (k in n) printf "  %-22s %3d thread(s) %8.1f\n", k, c[k], n[k]; printf "  %-22s %17.1f\n", "TOTAL", t }' |
        sort -k4 -rn
}

XDG_RUNTIME_DIR=$work "$bin/racekv" up --base-port 7611 --redis-port 7612 --metrics-addr 127.0.0.1:7613 \
    --remote-port 7614 > "$work/up.log" 2>&1 &
up=$!
pids+=("$up")
sleep 4
redis-cli -p 7612 set idle-check 1 > /dev/null
sleep 2
measure "$up" "racekv up (shm)"
kill -INT "$up"
wait "$up" || true

"$bin/racekv-memnode" --listen-tcp 127.0.0.1:7711 --listen-shm none --metrics-addr none \
    --region-bytes 64MiB > "$work/memnode.log" 2>&1 &
memnode=$!
pids+=("$memnode")
sleep 1
"$bin/racekv-computenode" --memnodes tcp:127.0.0.1:7711 --redis-addr 127.0.0.1:7712 --attach-socket none \
    --remote-addr none --metrics-addr none > "$work/computenode.log" 2>&1 &
computenode=$!
pids+=("$computenode")
sleep 4
redis-cli -p 7712 set idle-check 1 > /dev/null
sleep 2
measure "$memnode" "racekv-memnode (tcp, one computenode connected)" > "$work/memnode.txt" &
measuring=$!
measure "$computenode" "racekv-computenode (tcp to the memnode)" > "$work/computenode.txt"
wait "$measuring"
cat "$work/memnode.txt" "$work/computenode.txt"
