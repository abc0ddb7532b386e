#!/bin/bash
# Runs the many-core benchmarks issues 3, 17 and 18 still need on a lent machine (device tool):
#   bash ops/device/pack.sh                      # here, first
#   run: ONLY="spike-tcp-8 spike-tcp-24 redis-p1" bash ops/device/run.sh   carry: bench-results/device
# Results (JSON, stderr tails, plots) go to $OUT. Without ONLY every benchmark runs (about
# 20 minutes on 16 cores).
set -u
D=$(cd "$(dirname "$0")/../../bench-results/device" && pwd)
export PATH="$D/bin:$PATH" LD_LIBRARY_PATH="$D/lib" RACEKV_LOG=warn
mkdir -p /usr/share/fonts/truetype/dejavu && cp -n "$D/DejaVuSans.ttf" /usr/share/fonts/truetype/dejavu/ 2>/dev/null
cd "${OUT:?set OUT to the results folder}"
nproc; lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)"; uname -r; head -2 /etc/os-release
redis-server --version; valkey-server --version 2>&1 | head -1
ls /sys/class/infiniband 2>&1
R=$D/racekv
"$R" doctor 2>&1 | head -20
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
run() {
    local name=$1; shift
    want "$name" || return 0
    echo "== $name: racekv $*"
    local t0=$SECONDS
    timeout 300 "$R" "$@" --json > "$name.json" 2> "$name.err"
    echo "rc=$? in $(( SECONDS - t0 )) s"; head -c 800 "$name.json"; echo; tail -3 "$name.err"
}
run attach-shm bench attach --transport shm
run attach-tcp bench attach --transport tcp
run coldstart bench coldstart --runs 200
run spike-tcp-8 bench spike --transport tcp --workers-before 1 --workers-after 8 --plot "$OUT/spike-tcp-8.png"
run spike-tcp-24 bench spike --transport tcp --workers-before 1 --workers-after 24 --plot "$OUT/spike-tcp-24.png"
run redis-p1 bench redis --rounds 3 --requests 1000000
# The region on 2 MiB pages needs them reserved (4 GiB here; the lent machines have 128).
want redis-p1-huge && { echo 2048 > /proc/sys/vm/nr_hugepages; grep HugePages_Total /proc/meminfo; }
run redis-p1-huge bench redis --rounds 3 --requests 1000000 --huge-pages
run redis-p1-loops2 bench redis --rounds 3 --requests 1000000 --event-loops 2
run redis-p1-spin50 bench redis --rounds 3 --requests 1000000 --poll-spin-us 50
run redis-t4 bench redis --benchmark-threads 4 --rounds 3 --requests 1000000
run rpc-tcp bench rpc --transport tcp --threads 1,2,4,8,16,32,64 --plot "$OUT/rpc-tcp.png"
# Shorter variants for a tight device budget: Redis at P1 with fewer requests, and FLOCK's
# coalescing against per-thread connections with 4 lanes (after the credit-window fix).
run redis-p1-short bench redis --pipeline 1 --rounds 3 --requests 300000
run rpc-tcp-credit bench rpc --transport tcp --threads 8,32 --modes per_thread,coalescing --lanes 4
# GET and SET against redis-server and valkey-server (io-threads = cores) in the same rounds.
run redis-valkey-t4 bench redis --ops get,set --benchmark-threads 4 --rounds 3 --requests 1000000
# Issue 17: R = 1, 2, 3 SET latency over tcp with cores to spare for the memnodes, and
# failover times (ops/bench-replication.sh on the packed binaries; ~4 minutes).
if want replication; then
    echo "== replication: ops/bench-replication.sh --tcp-only"
    mkdir -p /tmp/racekv-packed/release
    ln -sf "$R" "$D/racekv-memnode" /tmp/racekv-packed/release/
    t0=$SECONDS
    (cd "$D/../.." && CARGO_TARGET_DIR=/tmp/racekv-packed timeout 420 bash ops/bench-replication.sh --no-build \
        --tcp-only --rounds 2 --requests 100000 --failovers 5) > replication.json 2> replication.err
    echo "rc=$? in $(( SECONDS - t0 )) s"; tail -c 1500 replication.json; echo; tail -3 replication.err
fi
