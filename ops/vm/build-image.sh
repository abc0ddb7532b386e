#!/usr/bin/env bash
# Builds (or reuses) the Debian bookworm image the Soft-RoCE test VM boots, and prints its
# directory (vmlinuz, initrd.img, disk.img). The image is cached under ops/vm/cache/ (or
# $RACEKV_VM_CACHE), keyed by a hash of the suite, package list, disk size and boot script
# below: change any of them and the next run builds a new image (and drops the old one).
# Needs root (debootstrap) and network access to the Debian mirror ($RACEKV_VM_MIRROR).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${RACEKV_VM_CACHE:-$here/cache}
mirror=${RACEKV_VM_MIRROR:-http://deb.debian.org/debian}

suite=bookworm
# rdma-core + ibverbs-providers: the rxe provider; kmod: modprobe; iproute2: ip and rdma;
# ibverbs-utils and perftest: ibv_devinfo, ib_*_lat for debugging by hand.
packages=(linux-image-amd64 kmod iproute2 rdma-core ibverbs-providers ibverbs-utils libibverbs1 librdmacm1 perftest)
disk_size=2G

# PID 1 of the VM: mount the basics and the host share, then hand over to the run's
# guest-init.sh (which lives in the share, so changing it needs no new image).
read -r -d '' boot_script <<'EOF' || true
#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# The initramfs hands over /sys and /dev already mounted.
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sys /sys
mountpoint -q /dev || mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
modprobe 9pnet_virtio
modprobe 9p
mkdir -p /mnt/host
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 host /mnt/host && [ -f /mnt/host/guest-init.sh ]; then
    exec /bin/bash /mnt/host/guest-init.sh
fi
echo "RACEKV-VM-SETUP-FAILED cannot mount the host share"
echo o > /proc/sysrq-trigger
sleep 30
EOF

key=$(printf '%s\n' "v1" "$suite" "${packages[@]}" "$disk_size" "$boot_script" | sha256sum | cut -c1-16)
image=$cache/image-$key
if [[ -f $image/ready ]]; then
    echo "$image"
    exit 0
fi

log() { echo "build-image: $*" >&2; }
if [[ $(id -u) -ne 0 ]]; then
    log "building the VM image needs root (debootstrap, mkfs.ext4 -d preserving ownership)"
    exit 1
fi
for tool in debootstrap mkfs.ext4; do
    command -v "$tool" >/dev/null || { log "$tool missing: run ops/vm/install-deps.sh"; exit 1; }
done

mkdir -p "$cache"
work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$(date +%s)
log "debootstrap $suite (${packages[*]}) from $mirror; log in $work/debootstrap.log"
if ! debootstrap --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" "$suite" "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1; then
    tail -n 40 "$work/debootstrap.log" >&2
    log "debootstrap failed"
    exit 1
fi
printf '%s\n' "$boot_script" >"$work/rootfs/racekv-boot"
chmod 755 "$work/rootfs/racekv-boot"
echo racekv-vm >"$work/rootfs/etc/hostname"
kernel=$(ls "$work"/rootfs/boot/vmlinuz-* | sort -V | tail -n 1)
initrd=$(ls "$work"/rootfs/boot/initrd.img-* | sort -V | tail -n 1)
cp "$kernel" "$work/vmlinuz"
cp "$initrd" "$work/initrd.img"
basename "$kernel" | sed 's/^vmlinuz-//' >"$work/kernel-version"
rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
mkfs.ext4 -q -d "$work/rootfs" -F "$work/disk.img" "$disk_size" >&2
rm -rf "$work/rootfs"
touch "$work/ready"

# Publish atomically; drop images of other keys.
for old in "$cache"/image-*; do
    [[ -e $old && $old != "$image" ]] && rm -rf "$old"
done
mv "$work" "$image"
trap - EXIT
log "image $image built in $(( $(date +%s) - started )) s (kernel $(cat "$image/kernel-version"))"
echo "$image"
