#!/usr/bin/env bash
# A racekv cluster from the container image, driven from the host (ops/test.sh runs it):
#
#   sudo ops/container/cluster-test.sh [--image racekv:latest] [--remove-image]
#
# Starts two memnodes and one computenode from the image (ops/container/build.sh) on a podman
# network of their own (the computenode reaches the memnodes by container name, over tcp with
# a shared token), the computenode's Redis port published on 127.0.0.1 only and protected by a
# password. Then from the host: redis-cli SET/GET/INCR, a 1 MiB value, keys over both
# memnodes, DBSIZE, INFO, a refused unauthenticated client; `racekv status` and `racekv get`
# from the image's own CLI (its entry point); and that every daemon runs as the image's
# non-root user. Removes the containers and the network at the end, pass or fail, and the
# image tag too with --remove-image. Needs root, podman, redis-cli.
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
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "cluster-test.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
fail() { echo "container cluster test FAILED: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || fail "run as root"
command -v redis-cli > /dev/null || fail "redis-cli missing (redis-tools)"
uid=10001
prefix=racekv-ct-$$
net=$prefix-net
memnodes=("$prefix-memnode-0" "$prefix-memnode-1")
computenode=$prefix-computenode
containers=("${memnodes[@]}" "$computenode")
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
# ETCD: when racekv gains --etcd (another issue), start an etcd container on "$net" here,
# before the daemons, and pass its address to each of them (and add it to "containers").

for m in "${memnodes[@]}"; do
    podman run -d --name "$m" --network "$net" \
        --entrypoint /usr/local/bin/racekv-memnode \
        -v "$work/token:/run/secrets/racekv-token:ro" \
        -e RACEKV_MEMNODE_TOKEN_FILE=/run/secrets/racekv-token \
        -e RACEKV_MEMNODE_LISTEN_TCP=0.0.0.0:7400 \
        -e RACEKV_MEMNODE_METRICS_ADDR=0.0.0.0:9400 \
        -e RACEKV_MEMNODE_REGION_BYTES=64MiB \
        -e RACEKV_MEMNODE_GROUPS_PER_SUBTABLE=4 \
        "$image" > /dev/null
done
for m in "${memnodes[@]}"; do echo "$m: $(racekv_wait_ready "$m")"; done

podman run -d --name "$computenode" --network "$net" \
    --entrypoint /usr/local/bin/racekv-computenode \
    -p 127.0.0.1::6380 -p 127.0.0.1::9401 \
    -v "$work/token:/run/secrets/racekv-token:ro" \
    -v "$work/requirepass:/run/secrets/racekv-requirepass:ro" \
    -e RACEKV_COMPUTENODE_TOKEN_FILE=/run/secrets/racekv-token \
    -e RACEKV_COMPUTENODE_REQUIREPASS_FILE=/run/secrets/racekv-requirepass \
    -e "RACEKV_COMPUTENODE_MEMNODES=tcp:${memnodes[0]}:7400,tcp:${memnodes[1]}:7400" \
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

# Enough keys that consistent hashing puts some on each memnode.
for i in $(seq 200); do printf 'SET key:%d value-%d\n' "$i" "$i"; done | rcli > "$work/sets"
[[ $(grep -c '^OK$' "$work/sets") -eq 200 ]] || fail "200 SETs: $(sort "$work/sets" | uniq -c)"
expect value-137 GET key:137
expect 203 DBSIZE
rcli INFO server > "$work/info"
grep -q '^redis_version:' "$work/info" || fail "INFO server has no redis_version: $(head -5 "$work/info")"
rcli INFO keyspace | grep -q '^db0:keys=203' || fail "INFO keyspace: $(rcli INFO keyspace)"

# The image's CLI (its entry point), inside the network: status over both memnodes, whose
# keys must add up to the 203 written (items as the memnodes count them), and the
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
assert len(items) == 2 and all(n > 0 for n in items), f"keys per memnode: {items}"
assert sum(items) == 203, f"keys per memnode {items} do not add up to 203"
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

# A clean stop: SIGTERM reaches the daemon (PID 1 of its container), which exits 0.
podman stop -t 10 "$computenode" > /dev/null
code=$(podman inspect --format '{{.State.ExitCode}}' "$computenode")
[[ $code -eq 0 ]] || fail "computenode exited $code on SIGTERM"
podman logs "$computenode" 2>&1 | grep -q 'stopped cleanly' || echo "(no 'stopped cleanly' line in the computenode's log)"

echo "container cluster test passed (image $image)"
