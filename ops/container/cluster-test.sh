#!/usr/bin/env bash
# A racekv cluster from the container image, driven from the host (ops/test.sh runs it):
#
#   sudo ops/container/cluster-test.sh [--image racekv:latest] [--remove-image]
#
# Starts an etcd, two memnodes registered in it, a cluster map with R = 2 (`racekv cluster
# init`), a computenode routing by that map, and a failover checker (`racekv cluster
# manage`), all on a podman network of their own: racekv's from the image
# (ops/container/build.sh, built with etcd), etcd from the host's etcd-server package in a
# root filesystem of its own (nothing is pulled). The computenode reaches the memnodes by
# container name, over tcp with a shared token; its Redis port is published on 127.0.0.1
# only and protected by a password. Then from the host: redis-cli SET/GET/INCR, a 1 MiB
# value, DBSIZE, INFO, a refused unauthenticated client; `racekv status` and `racekv get`
# from the image's own CLI (its entry point); that every daemon runs as a non-root user;
# then a memnode SIGKILLed: the checker fails it over and every key is read and written on
# the other. Removes the containers and the network at the end, pass or fail, and the image
# tag too with --remove-image. Needs root, podman, redis-cli, etcd (etcd-server).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=ops/container/lib.sh
source "$here/lib.sh"
image=racekv:latest
remove_image=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --image) image=$2; shift 2 ;;
        --remove-image) remove_image=1; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "cluster-test.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
fail() { echo "container cluster test FAILED: $*" >&2; exit 1; }
# logged CONTAINER TEXT: whether the container's log has TEXT. (Not `podman logs | grep -q`:
# grep exits at the first match, podman then dies of SIGPIPE writing the lines after it,
# and pipefail makes the whole pipeline fail.)
logged() { local log; log=$(podman logs "$1" 2>&1) || true; [[ $log == *"$2"* ]]; }
[[ $(id -u) -eq 0 ]] || fail "run as root"
command -v redis-cli > /dev/null || fail "redis-cli missing (redis-tools)"
command -v etcd > /dev/null || fail "etcd missing (etcd-server)"
uid=10001
prefix=racekv-ct-$$
net=$prefix-net
etcd=$prefix-etcd
memnodes=("$prefix-memnode-0" "$prefix-memnode-1")
computenode=$prefix-computenode
manager=$prefix-manage
containers=("$etcd" "${memnodes[@]}" "$computenode" "$manager")
work=$(mktemp -d)
cleanup() {
    local rc=$?
    if [[ $rc -ne 0 ]]; then
        for c in "${containers[@]}"; do
            podman container exists "$c" || continue
            podman logs --tail 20 "$c" 2>&1 | sed "s/^/[$c] /" >&2 || true
        done
    fi
    for c in "${containers[@]}"; do podman rm -f -t 2 "$c" > /dev/null 2>&1 || true; done
    podman network rm -f "$net" > /dev/null 2>&1 || true
    if [[ $remove_image -eq 1 ]]; then podman rmi "$image" > /dev/null 2>&1 || true; fi
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
racekv_fix_hybrid_cgroups
podman image exists "$image" || fail "no image $image: run ops/container/build.sh first"

# Secrets as files readable only by the image's user, mounted read-only (never in argv or
# the environment): the memnodes' token and the Redis password.
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/requirepass"
chown "$uid:$uid" "$work/token" "$work/requirepass"
chmod 0400 "$work/token" "$work/requirepass"
password=$(cat "$work/requirepass")

podman network create "$net" > /dev/null

# etcd: the host's binary and exactly the libraries it loads, as a root filesystem.
etcd_root=$work/etcd-root
install -d -m 0755 "$etcd_root/usr/bin" "$etcd_root/etc"
install -d -m 1777 "$etcd_root/tmp"
cp -L "$(command -v etcd)" "$etcd_root/usr/bin/etcd"
ldd "$(command -v etcd)" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' |
    while read -r lib; do install -d "$etcd_root$(dirname "$lib")"; cp -L "$lib" "$etcd_root$lib"; done
podman run -d --name "$etcd" --network "$net" --user "$uid:$uid" --rootfs "$etcd_root" \
    /usr/bin/etcd --name ct --data-dir /tmp/etcd \
    --listen-client-urls http://0.0.0.0:2379 --advertise-client-urls "http://$etcd:2379" \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster ct=http://127.0.0.1:2380 > /dev/null
# Up to 60 s: on a loaded 2-core machine the container's start alone has taken over 10 s.
for _ in $(seq 600); do
    logged "$etcd" 'ready to serve client requests' && break
    sleep 0.1
done
logged "$etcd" 'ready to serve client requests' || fail "etcd did not start"
etcd_url=http://$etcd:2379
echo "$etcd: etcd serving on $etcd_url"

# Memnodes register in etcd under a 1 s lease, by their names on the network.
for m in "${memnodes[@]}"; do
    podman run -d --name "$m" --network "$net" \
        --entrypoint /usr/local/bin/racekv-memnode \
        -v "$work/token:/run/secrets/racekv-token:ro" \
        -e RACEKV_MEMNODE_TOKEN_FILE=/run/secrets/racekv-token \
        -e RACEKV_MEMNODE_LISTEN_TCP=0.0.0.0:7400 \
        -e RACEKV_MEMNODE_METRICS_ADDR=0.0.0.0:9400 \
        -e RACEKV_MEMNODE_REGION_BYTES=64MiB \
        -e RACEKV_MEMNODE_GROUPS_PER_SUBTABLE=4 \
        -e RACEKV_MEMNODE_ETCD_ENDPOINTS="$etcd_url" \
        -e RACEKV_MEMNODE_ETCD_LEASE_MS=1000 \
        -e RACEKV_MEMNODE_ADVERTISE_ENDPOINTS="tcp:$m:7400" \
        "$image" > /dev/null
done
for m in "${memnodes[@]}"; do echo "$m: $(racekv_wait_ready "$m")"; done
cluster_cli() { podman run --rm --network "$net" "$image" cluster "$@" --etcd "$etcd_url"; }
cluster_cli init --replicas 2 || fail "racekv cluster init in the image"

podman run -d --name "$manager" --network "$net" "$image" \
    cluster manage --etcd "$etcd_url" --metrics-addr 0.0.0.0:9402 > /dev/null
echo "$manager: $(racekv_wait_ready "$manager")"

podman run -d --name "$computenode" --network "$net" \
    --entrypoint /usr/local/bin/racekv-computenode \
    -p 127.0.0.1::6380 -p 127.0.0.1::9401 \
    -v "$work/token:/run/secrets/racekv-token:ro" \
    -v "$work/requirepass:/run/secrets/racekv-requirepass:ro" \
    -e RACEKV_COMPUTENODE_TOKEN_FILE=/run/secrets/racekv-token \
    -e RACEKV_COMPUTENODE_REQUIREPASS_FILE=/run/secrets/racekv-requirepass \
    -e RACEKV_COMPUTENODE_ETCD_ENDPOINTS="$etcd_url" \
    -e RACEKV_COMPUTENODE_REDIS_ADDR=0.0.0.0:6380 \
    -e RACEKV_COMPUTENODE_METRICS_ADDR=0.0.0.0:9401 \
    "$image" > /dev/null
echo "$computenode: $(racekv_wait_ready "$computenode")"
redis_port=$(podman port "$computenode" 6380/tcp | head -1 | sed 's/.*://')
metrics_port=$(podman port "$computenode" 9401/tcp | head -1 | sed 's/.*://')
[[ -n $redis_port && -n $metrics_port ]] || fail "published ports not found"
echo "computenode: Redis on 127.0.0.1:$redis_port, metrics on 127.0.0.1:$metrics_port"

rcli() { redis-cli -h 127.0.0.1 -p "$redis_port" -a "$password" --no-auth-warning "$@"; }
expect() { # expect WANT redis-cli-args...: the reply must be WANT
    local want=$1 got
    shift
    got=$(rcli "$@") || fail "redis-cli $* exited non-zero"
    [[ $got == "$want" ]] || fail "redis-cli $*: expected '$want', got '$got'"
}

# Protected: no password, no service.
noauth=$(redis-cli -h 127.0.0.1 -p "$redis_port" GET anything 2>&1 || true)
[[ $noauth == *NOAUTH* ]] || fail "a client without the password got '$noauth', not NOAUTH"

expect PONG PING
expect OK SET greeting hello
expect hello GET greeting
expect 1 INCR counter
expect 42 INCRBY counter 41
expect 42 GET counter

# A 1 MiB value, byte for byte.
head -c 786432 /dev/urandom | base64 -w0 > "$work/big"
[[ $(stat -c %s "$work/big") -eq 1048576 ]] || fail "test value is not 1 MiB"
expect OK -x SET big < "$work/big"
expect 1048576 STRLEN big
rcli GET big > "$work/big.got"
printf '\n' >> "$work/big"
cmp -s "$work/big" "$work/big.got" || fail "GET of the 1 MiB value returned other bytes"

# Enough keys that each memnode is primary for some (both hold every key: R = 2).
for i in $(seq 200); do printf 'SET key:%d value-%d\n' "$i" "$i"; done | rcli > "$work/sets"
[[ $(grep -c '^OK$' "$work/sets") -eq 200 ]] || fail "200 SETs: $(sort "$work/sets" | uniq -c)"
expect value-137 GET key:137
expect 203 DBSIZE
rcli INFO server > "$work/info"
grep -q '^redis_version:' "$work/info" || fail "INFO server has no redis_version: $(head -5 "$work/info")"
rcli INFO keyspace > "$work/keyspace"
grep -q '^db0:keys=203' "$work/keyspace" || fail "INFO keyspace: $(cat "$work/keyspace")"

# The image's CLI (its entry point), inside the network: status over both memnodes, each
# holding all 203 keys written (R = 2; items as the memnodes count them), and the
# computenode's /status, found by its address on the network.
cn_ip=$(podman inspect --format '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$computenode")
podman run --rm --network "$net" -v "$work/token:/run/secrets/racekv-token:ro" \
    --entrypoint /usr/local/bin/racekv "$image" --version > /dev/null || fail "racekv --version in the image"
token=$(cat "$work/token")
# RACEKV_TOKEN: racekv's CLI takes the token from the environment or argv only; this one is
# thrown away with the cluster.
podman run --rm --network "$net" -e RACEKV_TOKEN="$token" "$image" status --json \
    --memnode "tcp:${memnodes[0]}:7400,tcp:${memnodes[1]}:7400" --computenode "$cn_ip:9401" \
    > "$work/status.json" || fail "racekv status from the image failed"
python3 - "$work/status.json" <<'PY' || fail "racekv status: $(cat "$work/status.json")"
import json, sys
s = json.load(open(sys.argv[1]))
items = [m["stats"]["items"] for m in s["memnodes"]]
assert items == [203, 203], f"keys per memnode {items}, not 203 on each (R = 2)"
cn = s["computenode"]
assert cn and cn["workers"] >= 1, f"computenode status: {cn}"
healthy = [m["healthy_connections"] for m in cn["memnodes"]]
assert len(healthy) == 2 and all(h > 0 for h in healthy), f"healthy connections: {healthy}"
print(f"racekv status (from the image): keys per memnode {items}, computenode healthy")
PY
curl -sf "http://127.0.0.1:$metrics_port/metrics" > "$work/metrics" || fail "no /metrics on the published port"
grep -q '^racekv_' "$work/metrics" || fail "no racekv metrics on the published port"
# Attached mode inside the computenode's container: the CLI finds the daemon's socket.
got=$(podman exec "$computenode" racekv get greeting) || fail "racekv get (attached) in the computenode container"
[[ $got == hello ]] || fail "racekv get (attached): '$got'"

# Every daemon runs as the image's non-root user: the container config, and the process's
# real, effective, saved and filesystem ids as the host's /proc sees them.
for c in "${containers[@]}"; do
    user=$(podman inspect --format '{{.Config.User}}' "$c")
    [[ $user == "$uid:$uid" ]] || fail "$c is configured to run as '$user'"
    pid=$(podman inspect --format '{{.State.Pid}}' "$c")
    ids=$(awk '/^Uid:|^Gid:/ {print $2, $3, $4, $5}' "/proc/$pid/status" | tr '\n' ' ')
    [[ $ids == "$uid $uid $uid $uid $uid $uid $uid $uid " ]] || fail "$c (pid $pid) runs with uid/gid $ids"
    echo "$c: pid $pid runs as $(podman top "$c" user huser | tail -1 | xargs) (uid/gid $uid)"
done

# A memnode SIGKILLed: its lease lapses, the checker writes the map without it, and every
# key goes on on the other replica, read and written through the same Redis connection
# settings (the computenode follows the map).
podman kill -s KILL "${memnodes[1]}" > /dev/null
started=$(date +%s%N)
for _ in $(seq 150); do
    cluster_cli status --json > "$work/cluster.json" 2>/dev/null &&
        python3 -c 'import json,sys; sys.exit(json.load(open(sys.argv[1]))["epoch"] != 2)' "$work/cluster.json" && break
    sleep 0.1
done
python3 - "$work/cluster.json" <<'PY' || fail "no failover: $(cat "$work/cluster.json")"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["epoch"] == 2, f"map epoch {s['epoch']}"
down = [m for m in s["memnodes"] if not m["registered"]]
assert len(down) == 1 and down[0]["primary_partitions"] == 0 and down[0]["replica_partitions"] == 0, down
PY
echo "failover: map without the killed memnode after $(( ($(date +%s%N) - started) / 1000000 )) ms"
for _ in $(seq 100); do [[ $(rcli GET key:137 2>/dev/null) == value-137 ]] && break; sleep 0.1; done
expect value-137 GET key:137
for i in $(seq 200); do printf 'GET key:%d\n' "$i"; done | rcli > "$work/gets"
for i in $(seq 200); do echo "value-$i"; done | cmp -s - "$work/gets" || fail "keys lost after failover"
expect OK SET after-failover yes
expect yes GET after-failover
expect 43 INCR counter
expect 1 EXISTS big
echo "after failover: all 200 keys read, SET and INCR acknowledged on the survivor"

# A clean stop: SIGTERM reaches the daemon (PID 1 of its container), which exits 0.
podman stop -t 10 "$computenode" > /dev/null
code=$(podman inspect --format '{{.State.ExitCode}}' "$computenode")
[[ $code -eq 0 ]] || fail "computenode exited $code on SIGTERM"
logged "$computenode" 'stopped cleanly' || echo "(no 'stopped cleanly' line in the computenode's log)"

echo "container cluster test passed (image $image)"
