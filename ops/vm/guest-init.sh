#!/bin/bash
# Runs inside the test VM as PID 1 (exec'd by /racekv-boot once the host share is mounted at
# /mnt/host). Sets up Soft-RoCE (rxe0 on a dummy interface, used in loopback), runs every test
# of /mnt/host/tests.sh and prints one marker line per binary, then powers the VM off.
# Markers (read by run-tests.sh on the host):
#   RACEKV-VM-BOOTED ...                     the guest is up
#   RACEKV-VM-SETUP-FAILED <why>             Soft-RoCE could not be set up; no test ran
#   RACEKV-VM-RESULT <name> PASS|FAIL rc=N seconds=S
#   RACEKV-VM-DONE passed=N failed=M
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp RUST_BACKTRACE=1

marker() { echo "RACEKV-VM-$*"; }
power_off() {
    sync
    echo o >/proc/sysrq-trigger
    sleep 30
}
fail_setup() {
    marker "SETUP-FAILED $*"
    power_off
}

marker "BOOTED uptime=$(cut -d' ' -f1 /proc/uptime)s kernel=$(uname -r) cpus=$(nproc)"

ip link set lo up || fail_setup "ip link set lo up"
# A minimal root has no hosts file; tests name the loopback host `localhost`, as a real one can.
[[ -s /etc/hosts ]] || printf '127.0.0.1 localhost\n::1 localhost\n' >/etc/hosts || fail_setup "writing /etc/hosts"
modprobe rdma_rxe || fail_setup "modprobe rdma_rxe"
modprobe ib_uverbs || fail_setup "modprobe ib_uverbs"
# (Not dummy0: loading the dummy module creates that one itself.)
# Not dummy0: loading the dummy module creates that one by itself.
ip link add racekv0 type dummy || fail_setup "ip link add racekv0"
ip addr add 10.77.0.1/24 dev racekv0 || fail_setup "ip addr add"
ip link set racekv0 up || fail_setup "ip link set racekv0 up"
rdma link add rxe0 type rxe netdev racekv0 || fail_setup "rdma link add rxe0"
ulimit -l unlimited

# The port turns ACTIVE and the IPv4 GID appears asynchronously.
ready=
for _ in $(seq 100); do
    if grep -qs ACTIVE /sys/class/infiniband/rxe0/ports/1/state &&
        grep -qs 'ffff:0a4d:0001' /sys/class/infiniband/rxe0/ports/1/gids/*; then
        ready=1
        break
    fi
    sleep 0.1
done
[[ -n $ready ]] || fail_setup "rxe0 port 1 did not become ACTIVE with GID ::ffff:10.77.0.1"
rdma link show
marker "SOFT-ROCE-READY uptime=$(cut -d' ' -f1 /proc/uptime)s"

passed=0
failed=0
mkdir -p /tmp/bin /tmp/work

run_test() {
    local name=$1
    shift
    if ! cp "/mnt/host/bin/$name" "/tmp/bin/$name" || ! chmod +x "/tmp/bin/$name"; then
        echo "$name: could not copy the test binary into the guest (df: $(df -h /tmp | tail -1))"
    fi
    marker "START $name $*"
    local t0 t1 rc status
    # Per-binary limit: tests.sh (sourced below) sets it before its first run_test.
    local test_timeout=${RACEKV_TEST_TIMEOUT:-1200}
    t0=$(date +%s.%N)
    (cd /tmp/work && timeout --signal=KILL "$test_timeout" "/tmp/bin/$name" "$@")
    rc=$?
    t1=$(date +%s.%N)
    # /tmp is RAM in the guest: a binary is not kept once it ran (they are ~100 MB each).
    rm -f "/tmp/bin/$name"
    if [[ $rc -eq 0 ]]; then
        status=PASS
        passed=$((passed + 1))
    else
        status=FAIL
        failed=$((failed + 1))
        [[ $rc -eq 137 ]] && echo "$name: killed after ${test_timeout}s (or by a signal)"
    fi
    marker "RESULT $name $status rc=$rc seconds=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
}

# shellcheck source=/dev/null
. /mnt/host/tests.sh
marker "DONE passed=$passed failed=$failed"
power_off
