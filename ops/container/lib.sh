# Shared by ops/container/cluster-test.sh and bench.sh (sourced, not run): podman's
# configuration, the cgroup fix some CI hosts need, and starting racekv's daemons from the
# image and waiting for them.
# shellcheck shell=bash

container_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$container_dir/containers.conf}

# crun refuses to start containers on a host in cgroup "hybrid" mode (v1 hierarchies plus a
# cgroup2 mount at /sys/fs/cgroup/unified) while a controller is attached to the v2 side:
# "cgroups in hybrid mode not supported, drop all controllers from cgroupv2". On the CI
# machines that controller is hugetlb, the only one no v1 hierarchy holds; mounting a v1
# hugetlb hierarchy moves it there. Does nothing on a pure v1 or v2 host, or once done.
racekv_fix_hybrid_cgroups() {
    local v2=/sys/fs/cgroup/unified/cgroup.controllers controllers
    [[ -r $v2 ]] || return 0
    controllers=$(cat "$v2")
    [[ -n $controllers ]] || return 0
    if [[ $(id -u) -ne 0 ]]; then
        echo "cgroup v2 controllers ($controllers) in hybrid mode; crun will refuse: run as root" >&2
        return 1
    fi
    local c
    for c in $controllers; do
        echo "moving cgroup controller $c from the hybrid cgroup2 mount to a v1 hierarchy (crun needs none on v2)" >&2
        mkdir -p "/sys/fs/cgroup/$c"
        mountpoint -q "/sys/fs/cgroup/$c" || mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c"
    done
    controllers=$(cat "$v2")
    [[ -z $controllers ]] || { echo "cgroup2 still holds $controllers" >&2; return 1; }
}

# racekv_cgroup_like_a_container NAME PID: moves a host process into a cgroup of its own,
# NAME under racekv_direct, in each cgroup hierarchy where podman gives every container one
# (libpod-ID under libpod_parent; v1's cpu and cpuacct, or a v2 root). The kernel's fair
# scheduler weighs a group as one task: a daemon with 50 connection threads in the root
# cgroup outweighs a single-threaded client 50 to 1, the same daemon in a container 1 to 1.
# Grouped alike, a directly run cluster and a containerized one get the same share of the
# CPU, so comparing them measures the container, not the scheduler.
racekv_container_cgroup_roots=(/sys/fs/cgroup/cpu /sys/fs/cgroup/cpuacct /sys/fs/cgroup)
racekv_cgroup_like_a_container() {
    local name=$1 pid=$2 root dir
    for root in "${racekv_container_cgroup_roots[@]}"; do
        [[ -d $root/libpod_parent && -w $root/cgroup.procs ]] || continue
        dir=$root/racekv_direct/$name
        mkdir -p "$dir"
        echo "$pid" > "$dir/cgroup.procs"
    done
}

# racekv_remove_direct_cgroups: removes what racekv_cgroup_like_a_container made, once its
# processes have exited.
racekv_remove_direct_cgroups() {
    local root
    for root in "${racekv_container_cgroup_roots[@]}"; do
        [[ -d $root/racekv_direct ]] || continue
        rmdir "$root"/racekv_direct/* "$root/racekv_direct" 2>/dev/null || true
    done
}

# racekv_wait_ready NAME [SECONDS]: waits for a container's READY line on stdout; prints it.
racekv_wait_ready() {
    local name=$1 limit=${2:-30} line="" i
    for (( i = 0; i < limit * 10; i++ )); do
        line=$(podman logs "$name" 2>/dev/null | grep -m1 '^READY' || true)
        [[ -n $line ]] && { echo "$line"; return 0; }
        if [[ $(podman inspect --format '{{.State.Running}}' "$name" 2>/dev/null) != true ]]; then
            echo "container $name exited before it was ready; its log:" >&2
            podman logs "$name" >&2 2>&1 || true
            return 1
        fi
        sleep 0.1
    done
    echo "container $name not ready after ${limit} s; its log:" >&2
    podman logs "$name" >&2 2>&1 || true
    return 1
}
