#!/usr/bin/env bash
# GET throughput of a containerized racekv cluster against the same release binaries run
# directly on the host, in one run (the figures of docs/benchmarks.md, "Container image"):
#
#   sudo ops/container/bench.sh [--rounds 3] [--requests 1000000] [--memnodes 2] [--pipeline 16]
#                               [--network bridge|host] [--no-build] [--no-direct-cgroups]
#
# Builds the release image (ops/container/build.sh --profile release --tag racekv:bench;
# --no-build uses target/release and that tag as they are), then starts two clusters of the
# same shape: N memnodes and one computenode as host processes on loopback (target/release),
# and the same from the image on a podman network of its own, the computenode's Redis port
# published on 127.0.0.1 (--network host: the containers in the host's network namespace
# instead, on loopback, to tell the container's cost from the network path's). Both over tcp
# with a token and a Redis password. Loads the same 100,000 keys (64-byte values,
# key:000000000000.., redis-benchmark's -r names) into each, then runs redis-benchmark
# `-t get -n REQUESTS -c 50 -P PIPELINE -r 100000 -d 64` against each, alternating (direct,
# container; container, direct; ...), and prints each round, the medians and their ratio
# container / direct, each round's ratio and their geometric mean (the paired ratio), with
# the machine, date and commit, as JSON. Removes both clusters and the network at the end
# (the image stays, for --no-build). Needs root, podman, redis-benchmark (redis-tools).
#
# Each direct daemon runs in a cgroup of its own, as each container does (lib.sh,
# racekv_cgroup_like_a_container), so the scheduler shares the CPU alike between either
# cluster and redis-benchmark; --no-direct-cgroups leaves them in the caller's cgroup (as
# runs before 2026-11-29 measured).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=ops/container/lib.sh
source "$here/lib.sh"
rounds=3
requests=1000000
pipeline=16
n_memnodes=2
build=1
network=bridge
direct_cgroups=1
image=racekv:bench
keys=100000
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --requests) requests=$2; shift 2 ;;
        --memnodes) n_memnodes=$2; shift 2 ;;
        --pipeline) pipeline=$2; shift 2 ;;
        --network) network=$2; shift 2 ;;
        --no-build) build=0; shift ;;
        --no-direct-cgroups) direct_cgroups=0; shift ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "bench.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
fail() { echo "bench.sh: $*" >&2; exit 1; }
[[ $network == bridge || $network == host ]] || fail "--network is bridge or host, not $network"
[[ $(id -u) -eq 0 ]] || fail "run as root"
command -v redis-benchmark > /dev/null || fail "redis-benchmark missing (redis-tools)"
racekv_fix_hybrid_cgroups
if [[ $build -eq 1 ]]; then "$here/build.sh" --profile release --tag "$image"; fi
bin=${CARGO_TARGET_DIR:-$repo/target}/release
podman image exists "$image" || fail "no image $image (run without --no-build)"

uid=10001
prefix=racekv-bench-$$
net=$prefix-net
work=$(mktemp -d)
chmod 0755 "$work"
pids=()
names=()
containers=()
cleanup() {
    local rc=$?
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    for c in "${containers[@]}"; do podman rm -f -t 2 "$c" > /dev/null 2>&1 || true; done
    podman network rm -f "$net" > /dev/null 2>&1 || true
    racekv_remove_direct_cgroups
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/requirepass"
chown "$uid:$uid" "$work/token" "$work/requirepass"
chmod 0400 "$work/token" "$work/requirepass"
password=$(cat "$work/requirepass")

# Direct: host processes on loopback (root reads the 0400 files).
direct_memnodes=()
for (( i = 0; i < n_memnodes; i++ )); do
    port=$(( 17600 + i ))
    RACEKV_MEMNODE_TOKEN_FILE=$work/token "$bin/racekv-memnode" --listen-tcp "127.0.0.1:$port" \
        --metrics-addr none --region-bytes 256MiB > "$work/memnode-$i.out" 2> "$work/memnode-$i.err" &
    pids+=($!)
    names+=("memnode-$i")
    direct_memnodes+=("tcp:127.0.0.1:$port")
done
for (( i = 0; i < n_memnodes; i++ )); do
    for (( t = 0; t < 100; t++ )); do grep -qs '^READY' "$work/memnode-$i.out" && break; sleep 0.1; done
    grep -q '^READY' "$work/memnode-$i.out" || fail "direct memnode $i not ready: $(tail -5 "$work/memnode-$i.err")"
done
direct_port=16390
RACEKV_COMPUTENODE_TOKEN_FILE=$work/token RACEKV_COMPUTENODE_REQUIREPASS_FILE=$work/requirepass \
    RACEKV_COMPUTENODE_MEMNODES=$(IFS=,; echo "${direct_memnodes[*]}") \
    XDG_RUNTIME_DIR=$work \
    "$bin/racekv-computenode" --redis-addr "127.0.0.1:$direct_port" --remote-addr none --metrics-addr none \
    > "$work/computenode.out" 2> "$work/computenode.err" &
pids+=($!)
names+=(computenode)

# Containerized: the same shape from the image, on a podman network of its own (bridge) or
# in the host's network namespace (host: on loopback ports of their own).
ctr_memnodes=()
ctr_net=(--network host)
if [[ $network == bridge ]]; then
    podman network create "$net" > /dev/null
    ctr_net=(--network "$net")
fi
for (( i = 0; i < n_memnodes; i++ )); do
    name=$prefix-memnode-$i
    containers+=("$name")
    listen=0.0.0.0:7400 endpoint=tcp:$name:7400
    if [[ $network == host ]]; then listen=127.0.0.1:$(( 17700 + i )) endpoint=tcp:$listen; fi
    podman run -d --name "$name" "${ctr_net[@]}" --entrypoint /usr/local/bin/racekv-memnode \
        -v "$work/token:/run/secrets/racekv-token:ro" -e RACEKV_MEMNODE_TOKEN_FILE=/run/secrets/racekv-token \
        "$image" --listen-tcp "$listen" --metrics-addr none --region-bytes 256MiB > /dev/null
    ctr_memnodes+=("$endpoint")
done
for c in "${containers[@]}"; do racekv_wait_ready "$c" > /dev/null; done
computenode=$prefix-computenode
containers+=("$computenode")
redis=(-p 127.0.0.1::6380) redis_addr=0.0.0.0:6380
if [[ $network == host ]]; then redis=() redis_addr=127.0.0.1:16391; fi
podman run -d --name "$computenode" "${ctr_net[@]}" "${redis[@]}" \
    --entrypoint /usr/local/bin/racekv-computenode \
    -v "$work/token:/run/secrets/racekv-token:ro" -e RACEKV_COMPUTENODE_TOKEN_FILE=/run/secrets/racekv-token \
    -v "$work/requirepass:/run/secrets/racekv-requirepass:ro" \
    -e RACEKV_COMPUTENODE_REQUIREPASS_FILE=/run/secrets/racekv-requirepass \
    -e "RACEKV_COMPUTENODE_MEMNODES=$(IFS=,; echo "${ctr_memnodes[*]}")" \
    "$image" --redis-addr "$redis_addr" --remote-addr none --metrics-addr none > /dev/null
racekv_wait_ready "$computenode" > /dev/null
# Each direct daemon in a cgroup of its own, as each container is (now that podman has made
# its libpod_parent): see racekv_cgroup_like_a_container.
grouping=root
if [[ $direct_cgroups -eq 1 ]]; then
    for (( i = 0; i < ${#pids[@]}; i++ )); do racekv_cgroup_like_a_container "${names[i]}" "${pids[i]}"; done
    grep -qs racekv_direct "/proc/${pids[0]}/cgroup" && grouping="a cgroup per daemon under racekv_direct"
fi
if [[ $network == host ]]; then
    ctr_port=16391
else
    ctr_port=$(podman port "$computenode" 6380/tcp | head -1 | sed 's/.*://')
fi

for (( i = 0; i < 100; i++ )); do grep -qs '^READY' "$work/computenode.out" && break; sleep 0.1; done
grep -q '^READY' "$work/computenode.out" || fail "direct computenode not ready: $(tail -5 "$work/computenode.err")"

# The same keys in both (redis-benchmark -r 100000 asks for key:000000000000..key:000000099999).
awk -v n="$keys" 'BEGIN {
    v = sprintf("%064d", 0); gsub(/0/, "x", v)
    for (i = 0; i < n; i++) { k = sprintf("key:%012d", i); printf "*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$64\r\n%s\r\n", length(k), k, v }
}' > "$work/load.resp"
for port in "$direct_port" "$ctr_port"; do
    redis-cli -p "$port" -a "$password" --no-auth-warning --pipe < "$work/load.resp" > "$work/load.out" \
        || fail "loading keys on port $port: $(tail -3 "$work/load.out")"
    got=$(redis-cli -p "$port" -a "$password" --no-auth-warning DBSIZE)
    [[ $got -eq $keys ]] || fail "port $port holds $got keys after loading $keys"
done

run() { # run PORT: GETs per second of one redis-benchmark run
    redis-benchmark -h 127.0.0.1 -p "$1" -a "$password" --csv -t get -n "$requests" -c 50 -P "$pipeline" \
        -r "$keys" -d 64 2>/dev/null | awk -F'"' '$2 == "GET" {print $4}'
}
direct=()
ctr=()
for (( r = 1; r <= rounds; r++ )); do
    if (( r % 2 == 1 )); then
        direct+=("$(run "$direct_port")"); ctr+=("$(run "$ctr_port")")
    else
        ctr+=("$(run "$ctr_port")"); direct+=("$(run "$direct_port")")
    fi
    echo "round $r: direct ${direct[-1]} GET/s, container ${ctr[-1]} GET/s" >&2
done

size=$(podman image inspect --format '{{.Size}}' "$image")
python3 - "$size" "${direct[*]}" "${ctr[*]}" <<PY
import json, statistics, sys
size, direct, ctr = int(sys.argv[1]), [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
d, c = statistics.median(direct), statistics.median(ctr)
# Each round's two runs ran back to back (in alternating order), so their ratio is the least
# disturbed by the host's drift; their geometric mean is the paired estimate.
paired = [y / x for x, y in zip(direct, ctr)]
print(json.dumps({
    "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)",
    "host": "$(hostname)",
    "cpu": "$(lscpu | sed -n 's/^Model name: *//p' | head -1)",
    "cores": $(nproc),
    "kernel": "$(uname -r)",
    "podman": "$(podman --version | awk '{print $3}')",
    "redis_benchmark": "$(redis-benchmark --version | awk '{print $2}')",
    "commit": "$(git -C "$repo" rev-parse --short HEAD)",
    "image": "$image", "image_bytes": size,
    "command": "redis-benchmark -t get -n $requests -c 50 -P $pipeline -r $keys -d 64 (+ -a)",
    "memnodes": $n_memnodes,
    "container_network": "$network",
    "direct_cgroups": "$grouping",
    "direct_get_per_s": direct, "container_get_per_s": ctr,
    "direct_median": d, "container_median": c, "ratio": round(c / d, 3),
    "round_ratios": [round(r, 3) for r in paired],
    "paired_ratio": round(statistics.geometric_mean(paired), 3),
}, indent=2))
PY
