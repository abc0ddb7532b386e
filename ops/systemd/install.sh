#!/usr/bin/env bash
# Installs racekv's daemons as systemd services (Type=notify: a unit is "started" once the
# daemon serves).
#
#   cargo build --release && sudo ops/systemd/install.sh            install, enable, start
#   ops/systemd/install.sh --root /tmp/stage --bin-dir target/debug --no-start   stage only
#
# Puts the binaries in /usr/local/bin, the units in /etc/systemd/system, and, where absent,
# /etc/racekv/{memnode,computenode}.toml (from ops/config) and the env files holding a new
# random token shared by both (mode 0640, root:racekv). Existing configuration is kept.
# Creates the system user `racekv` when installing to /. Then verifies the units.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
root=/
bin_dir=$repo/target/release
start=1
while [[ $# -gt 0 ]]; do
    case $1 in
        --root) root=$2; shift 2 ;;
        --bin-dir) bin_dir=$2; shift 2 ;;
        --no-start) start=0; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
root=${root%/}
for bin in racekv racekv-memnode racekv-computenode; do
    [[ -x $bin_dir/$bin ]] || { echo "install.sh: $bin_dir/$bin missing: run cargo build --release (or --bin-dir)" >&2; exit 1; }
done

install -d "$root/usr/local/bin" "$root/etc/systemd/system" "$root/etc/racekv"
install -m 0755 "$bin_dir/racekv" "$bin_dir/racekv-memnode" "$bin_dir/racekv-computenode" "$root/usr/local/bin/"
install -m 0644 "$repo"/ops/systemd/racekv-{memnode,computenode}.service "$root/etc/systemd/system/"

group=root
if [[ -z $root ]]; then
    if ! getent passwd racekv > /dev/null; then
        useradd --system --no-create-home --home-dir /var/lib/racekv --shell /usr/sbin/nologin racekv
    fi
    group=racekv
fi
for daemon in memnode computenode; do
    [[ -e $root/etc/racekv/$daemon.toml ]] || install -m 0644 "$repo/ops/config/$daemon.toml" "$root/etc/racekv/"
done
if [[ ! -e $root/etc/racekv/memnode.env && ! -e $root/etc/racekv/computenode.env ]]; then
    token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
    (umask 027
     printf 'RACEKV_MEMNODE_TOKEN=%s\n' "$token" > "$root/etc/racekv/memnode.env"
     printf 'RACEKV_COMPUTENODE_TOKEN=%s\n' "$token" > "$root/etc/racekv/computenode.env")
    chgrp "$group" "$root"/etc/racekv/{memnode,computenode}.env
    chmod 0640 "$root"/etc/racekv/{memnode,computenode}.env
fi

if [[ -z $root ]]; then
    systemd-analyze verify racekv-memnode.service racekv-computenode.service
else
    # A staged root has no systemd of its own: verify copies whose binaries are the staged ones.
    check=$(mktemp -d)
    trap 'rm -rf "$check"' EXIT
    for unit in racekv-memnode.service racekv-computenode.service; do
        sed "s#^ExecStart=/usr/local/bin/#ExecStart=$root/usr/local/bin/#" "$root/etc/systemd/system/$unit" > "$check/$unit"
    done
    systemd-analyze verify "$check/racekv-memnode.service" "$check/racekv-computenode.service"
fi

if [[ -z $root && -d /run/systemd/system ]]; then
    systemctl daemon-reload
    if [[ $start -eq 1 ]]; then
        systemctl enable --now racekv-memnode.service racekv-computenode.service
        systemctl --no-pager status racekv-memnode.service racekv-computenode.service | head -20
    fi
fi
echo "installed racekv under ${root:-/}"
