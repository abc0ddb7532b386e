#!/usr/bin/env bash
# What replication costs writes (issue 17's acceptance: PUT latency and throughput with
# R = 1, 2, 3 in one run), and how long a failover takes:
#
#   ops/bench-replication.sh [--rounds 3] [--requests 200000] [--failovers 5] [--tcp-only] [--no-build]
#
# Builds the release binaries with the etcd feature (--no-build uses target/release as it
# is) and starts three `racekv up --memnodes 3` clusters side by side, with --replicas 1, 2
# and 3, each with its own local etcd, ports and runtime directory. Loads 100,000 keys
# (64-byte values) into each, then runs redis-benchmark `-t set` and `-t get` (`-r 100000
# -d 64`) against each, the clusters alternating in every round: with one client (-c 1 -P 1,
# REQUESTS / 5 requests: the latency of one request alone) and with 50 (-c 50, at -P 1 and
# -P 16, REQUESTS: throughput; on 2 cores their latency is queueing for the CPU). Prints each
# run (requests/s, p50 and p99 latency in ms as redis-benchmark reports them) and R / (R = 1)
# ratios of the means as JSON. Then, on the R = 2 cluster,
# --failovers times: SIGSTOP one memnode and time (from the SIGSTOP) until the map without
# it is in etcd, and until a SET to each of 64 keys has succeeded (64 pipelined on one connection,
# each sent again 20 ms after an error reply; on shm a stopped memnode's
# memory still answers one-sided operations, so writes need not wait for the failover);
# SIGCONT it and time until `racekv up`'s healer has made it a replica again (R restored,
# its keys copied: the count from the healer's log line). Stops everything by pid at the
# end. --tcp-only: the computenodes reach the memnodes over loopback tcp (`racekv up
# --tcp-only`), where a stopped memnode stops answering one-sided operations too; --rounds 0
# measures failovers only. Needs etcd (etcd-server), redis-benchmark (redis-tools), protoc.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
rounds=3
requests=200000
failovers=5
build=1
tcp_only=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --requests) requests=$2; shift 2 ;;
        --failovers) failovers=$2; shift 2 ;;
        --no-build) build=0; shift ;;
        --tcp-only) tcp_only=(--tcp-only); shift ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "bench-replication.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
fail() { echo "bench-replication.sh: $*" >&2; exit 1; }
command -v etcd > /dev/null || fail "etcd missing (apt-get install etcd-server)"
command -v redis-benchmark > /dev/null || fail "redis-benchmark missing (redis-tools)"
command -v redis-cli > /dev/null || fail "redis-cli missing (redis-tools)"
if [[ $build -eq 1 ]]; then (cd "$repo" && cargo build --release --features etcd -p racekv -p racekv-memnode -q); fi
bin=${CARGO_TARGET_DIR:-$repo/target}/release

work=$(mktemp -d)
declare -A up_pid redis_port
cleanup() {
    local rc=$?
    for r in "${!up_pid[@]}"; do kill -CONT -- "-${up_pid[$r]}" 2>/dev/null || true; kill "${up_pid[$r]}" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT

# Starts `racekv up --replicas $1` on ports from $2 (etcd $2, $2+1; memnodes $2+10..;
# Redis $2+20; remote $2+21; metrics $2+22), in its own process group.
start_cluster() {
    local r=$1 base=$2
    mkdir -p "$work/run-$r"
    XDG_RUNTIME_DIR="$work/run-$r" RACEKV_LOG=warn setsid "$bin/racekv" up --memnodes 3 --replicas "$r" \
        --etcd-port "$base" --base-port $((base + 10)) --redis-port $((base + 20)) --remote-port $((base + 21)) \
        --metrics-addr "127.0.0.1:$((base + 22))" --region-bytes 256MiB ${tcp_only[@]+"${tcp_only[@]}"} \
        > "$work/up-$r.log" 2>&1 &
    up_pid[$r]=$!
    redis_port[$r]=$((base + 20))
    for _ in $(seq 1 600); do
        if grep -q "Ctrl-C stops the cluster" "$work/up-$r.log"; then return 0; fi
        kill -0 "${up_pid[$r]}" 2>/dev/null || fail "racekv up --replicas $r exited: $(tail -5 "$work/up-$r.log")"
        sleep 0.1
    done
    fail "racekv up --replicas $r did not start: $(tail -5 "$work/up-$r.log")"
}

load() {
    redis-benchmark -p "${redis_port[$1]}" -t set -n 100000 -r 100000 -d 64 -c 50 -P 16 -q > /dev/null
}

bases=([1]=21000 [2]=21100 [3]=21200)
clusters=(1 2 3)
[[ $rounds -gt 0 ]] || clusters=(2)    # failovers only: the R = 2 cluster
for r in "${clusters[@]}"; do start_cluster "$r" "${bases[$r]}"; done
for r in "${clusters[@]}"; do load "$r"; done

runs="$work/runs.jsonl"
: > "$runs"
# Each (clients, pipeline): 1 x 1 is the unloaded latency (one request in flight); 50 x 1
# and 50 x 16 load the cluster, where on 2 cores latency is queueing behind the CPU a
# write costs, so they measure throughput.
for round in $(seq 1 "$rounds"); do
    for test in set get; do
        for shape in "1 1" "50 1" "50 16"; do
            read -r clients pipeline <<< "$shape"
            n=$requests
            [[ $clients -gt 1 ]] || n=$((requests / 5))
            for r in 1 2 3; do
                csv=$(redis-benchmark -p "${redis_port[$r]}" -t "$test" -n "$n" -c "$clients" -r 100000 -d 64 \
                    -P "$pipeline" --csv | grep -v '^"test"')
                python3 - "$round" "$test" "$clients" "$pipeline" "$r" "$csv" >> "$runs" << 'EOF'
import csv, io, json, sys
round_, test, clients, pipeline, r, line = sys.argv[1:]
row = next(csv.reader(io.StringIO(line)))
print(json.dumps({"round": int(round_), "test": test, "clients": int(clients), "pipeline": int(pipeline),
                  "replicas": int(r), "rps": float(row[1]), "p50_ms": float(row[4]), "p99_ms": float(row[6])}))
EOF
                echo "round $round: $test -c $clients -P $pipeline R=$r: $(tail -1 "$runs")" >&2
            done
        done
    done
done

# Failover: on the R = 2 cluster, SIGSTOP one memnode; time until the map without it is in
# etcd (the failover), and until a SET to each of 64 keys has succeeded since the SIGSTOP.
epoch() {
    "$bin/racekv" cluster status --etcd "http://127.0.0.1:${bases[2]}" --json 2> /dev/null \
        | python3 -c 'import json,sys; print(json.load(sys.stdin).get("epoch") or 0)' 2> /dev/null || echo 0
}
# Whether every partition has R = 2 replicas again.
whole() {
    "$bin/racekv" cluster status --etcd "http://127.0.0.1:${bases[2]}" --json 2> /dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
held = sum(m["primary_partitions"] + m["replica_partitions"] for m in s["memnodes"])
sys.exit(0 if held == 2 * s["partitions"] else 1)' 2> /dev/null
}
# SETs 64 keys over one connection, pipelined, each sent again 20 ms after an error reply
# until every one was acknowledged. (One redis-cli per SET, as before 2026-11-28, added ~64
# sequential process starts, a few hundred ms, to the time measured.)
set_all_64() {
    python3 -c '
import socket, sys, time
port, value = int(sys.argv[1]), sys.argv[2].encode()
def command(*args):
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
pending, give_up = set(range(64)), time.monotonic() + 120
while pending and time.monotonic() < give_up:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            replies = s.makefile("rb")
            while pending:
                keys = sorted(pending)
                s.sendall(b"".join(command(b"SET", b"failover-%d" % k, value) for k in keys))
                for k in keys:
                    line = replies.readline()
                    if not line:
                        raise ConnectionError("closed")
                    if line.startswith(b"+OK"):
                        pending.discard(k)
                if pending:
                    time.sleep(0.02)
    except OSError:
        time.sleep(0.02)
sys.exit(1 if pending else 0)
' "$1" "$2" || fail "64 SETs not acknowledged within 120 s"
}
failover_ms=()
writes_ms=()
rejoin_ms=()
rejoin_keys=()
for n in $(seq 1 "$failovers"); do
    state="$work/run-2/racekv/up.json"
    victim=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["memnodes"]; print(m[int(sys.argv[2]) % len(m)]["pid"])' "$state" "$n")
    before=$(epoch)
    # The map is watched while the writes run (on tcp a write waiting on the stopped memnode
    # can outlast the failover).
    (until [[ $(epoch) -gt $before ]]; do sleep 0.02; done; date +%s%N > "$work/failover-$n") &
    watcher=$!
    start=$(date +%s%N)
    kill -STOP "$victim"
    set_all_64 "${redis_port[2]}" "$n"
    written=$(date +%s%N)
    wait "$watcher"
    end=$(cat "$work/failover-$n")
    failover_ms+=($(((end - start) / 1000000)))
    writes_ms+=($(((written - start) / 1000000)))
    echo "failover $n: map written $(((end - start) / 1000000)) ms after the SIGSTOP; every key written again after $(((written - start) / 1000000)) ms" >&2
    healed_lines=$(grep -c 'healed:' "$work/up-2.log" || true)
    kill -CONT "$victim"
    resumed=$(date +%s%N)
    until [[ $(grep -c 'healed:' "$work/up-2.log" || true) -gt $healed_lines ]] && whole; do
        [[ $(( ($(date +%s%N) - resumed) / 1000000000 )) -lt 120 ]] || fail "not healed 120 s after SIGCONT"
        sleep 0.05
    done
    healed=$(date +%s%N)
    synced=$(grep 'healed:' "$work/up-2.log" | tail -1 | grep -o 'synced=[0-9]*' | cut -d= -f2)
    rejoin_ms+=($(((healed - resumed) / 1000000)))
    rejoin_keys+=("$synced")
    echo "rejoin $n: R restored $(((healed - resumed) / 1000000)) ms after the SIGCONT, $synced keys copied" >&2
done

python3 - "$runs" "$(hostname)" "$(date -u +%FT%TZ)" "$(git -C "$repo" rev-parse --short HEAD)" \
    "$requests" "${failover_ms[*]:-}" "${writes_ms[*]:-}" "${rejoin_ms[*]:-}" "${rejoin_keys[*]:-}" "${tcp_only[*]:-}" << 'EOF'
import json, statistics, sys
path, host, date, commit, requests, failovers, writes, rejoins, rejoin_keys, tcp_only = sys.argv[1:]
runs = [json.loads(l) for l in open(path)]
summary = []
for test in ("set", "get"):
    for clients, pipeline in ((1, 1), (50, 1), (50, 16)):
        base = None
        for r in (1, 2, 3):
            sel = [x for x in runs if x["test"] == test and x["clients"] == clients and x["pipeline"] == pipeline
                   and x["replicas"] == r]
            if not sel:
                continue
            rps = statistics.mean(x["rps"] for x in sel)
            p50 = statistics.mean(x["p50_ms"] for x in sel)
            p99 = statistics.mean(x["p99_ms"] for x in sel)
            if r == 1:
                base = (rps, p50, p99)
            summary.append({"test": test, "clients": clients, "pipeline": pipeline, "replicas": r, "rps": round(rps),
                            "p50_ms": round(p50, 3), "p99_ms": round(p99, 3),
                            "rps_vs_r1": round(rps / base[0], 3), "p50_vs_r1": round(p50 / base[1], 3)})
f = sorted(int(x) for x in failovers.split()) if failovers else []
pct = lambda q: f[min(len(f) - 1, int(q * len(f)))] if f else None
print(json.dumps({"bench": "replication", "machine": host, "date": date, "commit": commit,
                  "transport": "tcp" if tcp_only else "shm",
                  "redis_benchmark": f"-n {requests} (a fifth at -c 1) -r 100000 -d 64", "summary": summary,
                  "failover_ms": f, "failover_p50_ms": pct(0.5), "failover_p99_ms": pct(0.99),
                  "all_keys_written_ms": [int(x) for x in writes.split()] if writes else [],
                  "rejoin_ms": [int(x) for x in rejoins.split()] if rejoins else [],
                  "rejoin_keys": [int(x) for x in rejoin_keys.split()] if rejoin_keys else [],
                  "rejoin_keys_per_second_from_sigcont": round(sum(int(x) for x in rejoin_keys.split()) * 1000 / max(1, sum(int(x) for x in rejoins.split()))) if rejoins else None,
                  "runs": runs}, indent=1))
EOF
