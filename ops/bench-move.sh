#!/usr/bin/env bash
# Partition moves under load (issue 17's acceptance: a move of about 1 M keys, its time, and
# client p99 during it against before it):
#
#   ops/bench-move.sh [--keys 3000000] [--requests 100000] [--max-keys-per-second 0] [--no-build]
#
# Builds the release binaries with the etcd feature (--no-build uses target/release as it
# is), starts `racekv up --memnodes 3 --replicas 1` (1 GiB regions, its own etcd and
# ports) and loads KEYS keys (key:%012d, 64-byte values, as redis-benchmark -r names them)
# through redis-cli --pipe. Then redis-benchmark GET and SET (-c 50 -P 1 -r KEYS -d 64,
# --csv) run three times each before the move; `racekv cluster remove-memnode` drains the
# memnode listed first (about a third of the keys, copied to the two others while the
# clients go on, at --max-keys-per-second, 0 for no cap) while GET and SET runs go on back
# to back; then three of each after. Checks that no command failed, DBSIZE is KEYS and
# every 997th key reads a 64-byte value, and prints JSON: keys moved, the move's seconds and
# keys/s, and per test the p50/p99 (ms) before, during (worst run) and after, with the
# during/before ratio. Stops everything by pid. Needs etcd (etcd-server), redis-tools,
# protoc.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
keys=3000000
requests=100000
rate=0
build=1
while [[ $# -gt 0 ]]; do
    case $1 in
        --keys) keys=$2; shift 2 ;;
        --requests) requests=$2; shift 2 ;;
        --max-keys-per-second) rate=$2; shift 2 ;;
        --no-build) build=0; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "bench-move.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
fail() { echo "bench-move.sh: $*" >&2; exit 1; }
for tool in etcd redis-benchmark redis-cli python3; do
    command -v "$tool" > /dev/null || fail "$tool missing (apt-get install etcd-server redis-tools python3)"
done
if [[ $build -eq 1 ]]; then (cd "$repo" && cargo build --release --features etcd -p racekv -p racekv-memnode -q); fi
bin=${CARGO_TARGET_DIR:-$repo/target}/release

base=21300
etcd_url=http://127.0.0.1:$base
redis_port=$((base + 20))
work=$(mktemp -d)
up_pid=
cleanup() {
    local rc=$?
    [[ -n $up_pid ]] && kill "$up_pid" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT

XDG_RUNTIME_DIR="$work/run" RACEKV_LOG=warn setsid "$bin/racekv" up --memnodes 3 --replicas 1 \
    --etcd-port "$base" --base-port $((base + 10)) --redis-port "$redis_port" --remote-port $((base + 21)) \
    --metrics-addr "127.0.0.1:$((base + 22))" --region-bytes 1GiB > "$work/up.log" 2>&1 &
up_pid=$!
mkdir -p "$work/run"
for _ in $(seq 1 600); do
    grep -q "Ctrl-C stops the cluster" "$work/up.log" && break
    kill -0 "$up_pid" 2>/dev/null || fail "racekv up exited: $(tail -5 "$work/up.log")"
    sleep 0.1
done
grep -q "Ctrl-C stops the cluster" "$work/up.log" || fail "racekv up did not start: $(tail -5 "$work/up.log")"

echo "loading $keys keys" >&2
python3 - "$keys" << 'EOF' | redis-cli -p "$redis_port" --pipe > "$work/load.log"
import sys
out = sys.stdout.buffer
value = b"x" * 64
for i in range(int(sys.argv[1])):
    key = b"key:%012d" % i
    out.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$64\r\n%s\r\n" % (len(key), key, value))
EOF
grep -q "errors: 0" "$work/load.log" || fail "loading failed: $(cat "$work/load.log")"

runs="$work/runs.jsonl"
: > "$runs"
# One redis-benchmark run of test $1 in phase $2, as a JSON line.
bench() {
    local csv
    csv=$(redis-benchmark -p "$redis_port" -t "$1" -n "$requests" -c 50 -r "$keys" -d 64 --csv | grep -v '^"test"')
    python3 - "$1" "$2" "$csv" >> "$runs" << 'EOF'
import csv, io, json, sys
test, phase, line = sys.argv[1:]
row = next(csv.reader(io.StringIO(line)))
print(json.dumps({"test": test, "phase": phase, "rps": float(row[1]), "p50_ms": float(row[4]), "p99_ms": float(row[6])}))
EOF
    echo "$2: $(tail -1 "$runs")" >&2
}
for _ in 1 2 3; do bench get before; bench set before; done

leaving=$("$bin/racekv" cluster status --etcd "$etcd_url" --json | python3 -c '
import json, sys
print(json.load(sys.stdin)["memnodes"][0]["node_id"])')
started=$(date +%s.%N)
"$bin/racekv" cluster remove-memnode --etcd "$etcd_url" "$leaving" --max-keys-per-second "$rate" \
    > "$work/move.out" 2> "$work/move.err" &
mover=$!
while kill -0 "$mover" 2>/dev/null; do bench get during; bench set during; done
wait "$mover" || fail "remove-memnode failed: $(tail -5 "$work/move.err")"
moved_s=$(python3 -c "import time; print(round(time.time() - $started, 2))")
cat "$work/move.out" >&2
for _ in 1 2 3; do bench get after; bench set after; done

dbsize=$(redis-cli -p "$redis_port" dbsize)
[[ $dbsize -eq $keys ]] || fail "DBSIZE $dbsize after the move, $keys keys loaded"
# Every key still there with a 64-byte value (the loaded one, or what a SET run wrote).
wrong=$(for i in $(seq 0 997 $((keys - 1))); do printf 'GET key:%012d\n' "$i"; done \
    | redis-cli -p "$redis_port" | awk 'length($0) != 64' | wc -l)
[[ $wrong -eq 0 ]] || fail "$wrong keys read back wrong after the move"

python3 - "$runs" "$work/move.out" "$moved_s" "$keys" << 'EOF'
import json, re, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
text = open(sys.argv[2]).read()
copied = int(re.search(r"(\d+) keys copied", text).group(1))
partitions = int(re.search(r"(\d+) partitions moved", text).group(1))
seconds = float(sys.argv[3])
result = {"keys": int(sys.argv[4]), "partitions_moved": partitions, "keys_moved": copied,
          "move_seconds": seconds, "keys_per_second": round(copied / seconds)}
for test in ("get", "set"):
    phase = {p: [r for r in runs if r["test"] == test and r["phase"] == p] for p in ("before", "during", "after")}
    row = {}
    for p, rs in phase.items():
        row[p] = {"runs": len(rs), "rps": round(statistics.mean(r["rps"] for r in rs)),
                  "p50_ms": round(statistics.mean(r["p50_ms"] for r in rs), 3),
                  "p99_ms": round(max(r["p99_ms"] for r in rs) if p == "during" else statistics.mean(r["p99_ms"] for r in rs), 3)}
    row["p99_during_over_before"] = round(row["during"]["p99_ms"] / row["before"]["p99_ms"], 2)
    result[test] = row
print(json.dumps(result, indent=2))
EOF
