#!/usr/bin/env bash
# Builds racekv's container image from scratch (no base image is pulled from anywhere):
#
#   sudo ops/container/build.sh                          release binaries, tag racekv:latest
#   sudo ops/container/build.sh --profile debug --tag T  the dev-profile binaries (what CI uses)
#
# One image holding the three binaries (racekv, racekv-memnode, racekv-computenode) in
# /usr/local/bin, exactly the shared libraries `ldd` lists for them plus the dynamic loader,
# an /etc/passwd and /etc/group with the non-root user racekv (uid/gid 10001) it runs as,
# a writable /tmp and /var/lib/racekv (the working directory, for data files) and
# XDG_RUNTIME_DIR=/run/racekv (the computenode's attach socket, so `podman exec NAME racekv
# get KEY` attaches to the daemon of that container). The entry point is `racekv`; the
# daemons run with `--entrypoint racekv-memnode` (or racekv-computenode). Binaries are
# built if needed with the etcd coordinator (`cargo build --workspace --bins --features
# racekv/etcd`, the command ops/prometheus/smoke-test.sh runs just before this in
# ops/test.sh, so there it rebuilds nothing; needs protoc) and copied with their debug info
# stripped (symbol names stay, for backtraces). `--no-etcd` builds without it.
#
# Needs root (buildah mounts the working container), buildah and podman (Debian packages,
# ops/install-packages.sh), ldd and objcopy (binutils). Prints the image's size at the end.
#
# Not supported yet: binaries built with `--features rdma` also load libibverbs, and
# libibverbs loads its provider libraries (/usr/lib/x86_64-linux-gnu/libibverbs/*.so, found
# through /etc/libibverbs.d) with dlopen, which ldd does not show; such an image would need
# those copied too, and the RDMA devices passed into the container.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
profile=release
tag=racekv:latest
features=(--features racekv/etcd)
while [[ $# -gt 0 ]]; do
    case $1 in
        --profile) profile=$2; shift 2 ;;
        --tag) tag=$2; shift 2 ;;
        --no-etcd) features=(); shift ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case $profile in
    release) cargo_flags=(--release); out=release ;;
    debug) cargo_flags=(); out=debug ;;
    *) echo "build.sh: --profile is release or debug, not $profile" >&2; exit 2 ;;
esac
[[ $(id -u) -eq 0 ]] || { echo "build.sh: run as root (buildah mount needs it)" >&2; exit 1; }
for tool in buildah podman ldd objcopy; do
    command -v "$tool" > /dev/null || { echo "build.sh: $tool missing (ops/install-packages.sh)" >&2; exit 1; }
done

bins=(racekv racekv-memnode racekv-computenode)
uid=10001
(cd "$repo" && cargo build --workspace --bins "${cargo_flags[@]}" "${features[@]}")
bin_dir=${CARGO_TARGET_DIR:-$repo/target}/$out
for bin in "${bins[@]}"; do
    [[ -x $bin_dir/$bin ]] || { echo "build.sh: $bin_dir/$bin missing after cargo build" >&2; exit 1; }
done
version=$("$bin_dir/racekv" --version | awk '{print $2}')
revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
source=$(sed -n 's/^repository *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -1)

work=$(mktemp -d)
ctr=""
cleanup() {
    if [[ -n $ctr ]]; then buildah rm "$ctr" > /dev/null 2>&1 || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

ctr=$(buildah from scratch)
root=$(buildah mount "$ctr")

# The binaries, debug info stripped from copies (the release profile keeps line tables).
install -d -m 0755 "$root/usr/local/bin"
for bin in "${bins[@]}"; do
    objcopy --strip-debug "$bin_dir/$bin" "$root/usr/local/bin/$bin"
    chmod 0755 "$root/usr/local/bin/$bin"
done

# Exactly the libraries the dynamic loader resolves for them, at the paths it finds them
# (symlinks followed), and the loader itself at its PT_INTERP path.
for bin in "${bins[@]}"; do
    if ldd "$bin_dir/$bin" | grep -q 'not found'; then
        echo "build.sh: $bin needs a library this host lacks:" >&2
        ldd "$bin_dir/$bin" >&2
        exit 1
    fi
    # Lines are `libx.so => /path (0x...)`, `/lib64/ld-linux-x86-64.so.2 (0x...)`, or the
    # vDSO (no path); a static binary prints "not a dynamic executable" and needs none.
    ldd "$bin_dir/$bin" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'
done | sort -u > "$work/libs"
while read -r lib; do
    install -d -m 0755 "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
    chmod 0755 "$root$lib"
done < "$work/libs"

# The user, name lookups (/etc/hosts, then DNS: podman's network resolves container names),
# and the writable directories.
install -d -m 0755 "$root/etc"
printf 'root:x:0:0:root:/root:/sbin/nologin\nracekv:x:%s:%s:racekv:/var/lib/racekv:/sbin/nologin\n' \
    "$uid" "$uid" > "$root/etc/passwd"
printf 'root:x:0:\nracekv:x:%s:\n' "$uid" > "$root/etc/group"
printf 'passwd: files\ngroup: files\nhosts: files dns\n' > "$root/etc/nsswitch.conf"
chmod 0644 "$root/etc/passwd" "$root/etc/group" "$root/etc/nsswitch.conf"
install -d -m 1777 "$root/tmp"
install -d -m 0755 "$root/var" "$root/var/lib" "$root/run"
install -d -m 0700 -o "$uid" -g "$uid" "$root/var/lib/racekv" "$root/run/racekv"
buildah umount "$ctr" > /dev/null

buildah config \
    --user "$uid:$uid" \
    --entrypoint '["/usr/local/bin/racekv"]' \
    --cmd '["--help"]' \
    --workingdir /var/lib/racekv \
    --env PATH=/usr/local/bin \
    --env XDG_RUNTIME_DIR=/run/racekv \
    --port 6380 --port 7400 --port 7410 --port 9400 --port 9401 \
    --label "org.opencontainers.image.title=racekv" \
    --label "org.opencontainers.image.description=racekv: memnode, computenode and CLI (entry point: racekv)" \
    --label "org.opencontainers.image.version=$version" \
    --label "org.opencontainers.image.revision=$revision" \
    --label "org.opencontainers.image.source=$source" \
    --label "org.opencontainers.image.licenses=Apache-2.0" \
    --label "racekv.profile=$profile" \
    "$ctr"
previous=$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
buildah commit --rm --quiet "$ctr" "$tag" > /dev/null
ctr=""
# The image the tag named before, unless something else still names or uses it.
if [[ -n $previous && $previous != "$(podman image inspect --format '{{.Id}}' "$tag")" ]]; then
    if [[ -z $(podman image inspect --format '{{join .RepoTags ""}}' "$previous" 2>/dev/null) ]]; then
        podman rmi "$previous" > /dev/null 2>&1 || true
    fi
fi

size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "build.sh: image $tag ($profile binaries of racekv $version, $(wc -l < "$work/libs") libraries):" \
    "$size bytes ($(( (size + 524288) / 1048576 )) MiB)"
