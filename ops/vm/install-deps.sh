#!/usr/bin/env bash
# Installs what the Soft-RoCE VM harness and the `rdma` feature need on a Debian/Ubuntu host:
#   running the VM:  qemu-system-x86 debootstrap e2fsprogs
#   building verbs:  libibverbs-dev librdmacm-dev libclang-dev pkg-config (rdma-sys runs bindgen)
# Run as root. Idempotent: installs only what is missing.
set -euo pipefail

packages=(qemu-system-x86 debootstrap e2fsprogs libibverbs-dev librdmacm-dev libclang-dev pkg-config)

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install-deps: all present (${packages[*]})"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing ${missing[*]}; run as root: sudo $0" >&2
    exit 1
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
