#!/usr/bin/env bash
# Runs test binaries inside a qemu VM (TCG) whose kernel has Soft-RoCE (rdma_rxe), so the verbs
# backend is tested against a real RDMA stack on a host without an RDMA NIC. See README.md.
#
# usage: ops/vm/run-tests.sh [options] BINARY [ARG...] [--- BINARY [ARG...]]...
# options:
#   --boot-timeout SECS   fail if the guest has not booted by then (default 300)
#   --timeout SECS        fail if the whole run takes longer (default 3600)
#   --test-timeout SECS   per-binary limit inside the guest (default 1200)
#   --mem MB / --cpus N   guest size (default 2048 / 2)
# Exit status: 0 only if the VM booted, set up Soft-RoCE, ran every binary, and all passed.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${RACEKV_VM_CACHE:-$here/cache}
boot_timeout=300
run_timeout=3600
test_timeout=1200
mem=2048
cpus=2

die() { echo "run-tests: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case $1 in
        --boot-timeout) boot_timeout=$2; shift 2 ;;
        --timeout) run_timeout=$2; shift 2 ;;
        --test-timeout) test_timeout=$2; shift 2 ;;
        --mem) mem=$2; shift 2 ;;
        --cpus) cpus=$2; shift 2 ;;
        -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1" ;;
        *) break ;;
    esac
done
[[ $# -gt 0 ]] || die "no test binary given (usage: $0 BINARY [ARG...] [--- BINARY [ARG...]]...)"

# Host tools; install them if we can.
if ! command -v qemu-system-x86_64 >/dev/null || ! command -v debootstrap >/dev/null || ! command -v mkfs.ext4 >/dev/null; then
    "$here/install-deps.sh" || die "host tools missing; run ops/vm/install-deps.sh as root"
fi

image=$("$here/build-image.sh") || die "could not build the VM image"

mkdir -p "$cache"
stage=$(mktemp -d "$cache/run.XXXXXX")
log=$stage/console.log
qemu_pid=
tail_pid=
cleanup() {
    [[ -n $qemu_pid ]] && kill "$qemu_pid" 2>/dev/null || true
    [[ -n $tail_pid ]] && kill "$tail_pid" 2>/dev/null || true
    rm -rf "$stage"
}
trap cleanup EXIT

# Stage the binaries and write the guest's test list (quoted for bash).
mkdir -p "$stage/share/bin"
cp "$here/guest-init.sh" "$stage/share/guest-init.sh"
tests_sh=$stage/share/tests.sh
printf 'RACEKV_TEST_TIMEOUT=%q\n' "$test_timeout" >"$tests_sh"
names=()
while [[ $# -gt 0 ]]; do
    binary=$1
    shift
    args=()
    while [[ $# -gt 0 && $1 != --- ]]; do
        args+=("$1")
        shift
    done
    [[ $# -gt 0 ]] && shift # the ---
    [[ -f $binary && -x $binary ]] || die "not an executable file: $binary"
    name=$(basename "$binary")
    while [[ -e $stage/share/bin/$name ]]; do name=$name.again; done
    cp "$binary" "$stage/share/bin/$name"
    names+=("$name")
    {
        printf 'run_test %q' "$name"
        for a in "${args[@]+"${args[@]}"}"; do printf ' %q' "$a"; done
        printf '\n'
    } >>"$tests_sh"
done
echo "run-tests: ${#names[@]} binaries: ${names[*]}"

: >"$log"
started=$(date +%s.%N)
qemu-system-x86_64 \
    -accel tcg,thread=multi -cpu max -m "$mem" -smp "$cpus" \
    -nodefaults -display none -no-reboot -monitor none \
    -serial "file:$log" \
    -kernel "$image/vmlinuz" -initrd "$image/initrd.img" \
    -drive "file=$image/disk.img,format=raw,if=virtio,snapshot=on" \
    -virtfs "local,path=$stage/share,mount_tag=host,security_model=none,readonly=on" \
    -append "console=ttyS0 root=/dev/vda rw init=/racekv-boot panic=-1 quiet" \
    >"$stage/qemu.out" 2>&1 &
qemu_pid=$!
tail -n +1 -F "$log" 2>/dev/null &
tail_pid=$!

elapsed() { awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
boot_seconds=
verdict=
while kill -0 "$qemu_pid" 2>/dev/null; do
    now=$(elapsed)
    if [[ -z $boot_seconds ]]; then
        if grep -q '^RACEKV-VM-BOOTED' "$log"; then
            boot_seconds=$now
        elif awk -v n="$now" -v t="$boot_timeout" 'BEGIN { exit !(n > t) }'; then
            verdict="the VM did not boot within ${boot_timeout}s"
            break
        fi
    fi
    if awk -v n="$now" -v t="$run_timeout" 'BEGIN { exit !(n > t) }'; then
        verdict="the run took longer than ${run_timeout}s"
        break
    fi
    sleep 0.5
done
if [[ -n $verdict ]]; then
    kill "$qemu_pid" 2>/dev/null || true
fi
wait "$qemu_pid" 2>/dev/null || true
qemu_pid=
sleep 0.3
kill "$tail_pid" 2>/dev/null || true
wait "$tail_pid" 2>/dev/null || true
tail_pid=
total=$(elapsed)

# Verdict from the markers (tr: the serial console may add carriage returns).
markers=$(tr -d '\r' <"$log" | grep '^RACEKV-VM-' || true)
echo
echo "================ run-tests summary ================"
if [[ -s $stage/qemu.out ]]; then
    echo "qemu said:"
    sed 's/^/  /' "$stage/qemu.out"
fi
status=0
if [[ -n $verdict ]]; then
    echo "FAIL: $verdict"
    status=1
fi
if grep -q '^RACEKV-VM-SETUP-FAILED' <<<"$markers"; then
    echo "FAIL: guest setup: $(grep '^RACEKV-VM-SETUP-FAILED' <<<"$markers" | head -n 1)"
    status=1
fi
for name in "${names[@]}"; do
    line=$(grep -F "RACEKV-VM-RESULT $name " <<<"$markers" | tail -n 1 || true)
    if [[ -z $line ]]; then
        echo "FAIL  $name: no result marker (did not run, or the VM died)"
        status=1
    elif [[ $line == *" PASS "* ]]; then
        echo "PASS  $name (${line##* })"
    else
        echo "FAIL  $name (${line#RACEKV-VM-RESULT "$name" })"
        status=1
    fi
done
grep -q '^RACEKV-VM-DONE' <<<"$markers" || { echo "FAIL: no DONE marker from the guest"; status=1; }
ready=$(grep '^RACEKV-VM-SOFT-ROCE-READY' <<<"$markers" | head -n 1 | sed 's/.*uptime=//' || true)
echo "timing: boot (qemu start to guest init) ${boot_seconds:-?}s, Soft-RoCE ready at guest uptime ${ready:-?}, whole run ${total}s"
[[ $status -eq 0 ]] && echo "all ${#names[@]} binaries passed in the Soft-RoCE VM" || echo "run-tests: FAILED"
exit $status
