#!/usr/bin/env bash
# racekv's whole test run: what `.ci/run` runs and what the README calls "test it".
#
#   bash ops/test.sh           everything (about 60 minutes on 2 cores)
#   bash ops/test.sh --quick   skip the Soft-RoCE VM suite and fuzzing
#
# Steps: packages; rustfmt; no import cycle between source files; clippy (warnings are
# errors); `cargo test --workspace`; the `rdma` build; the `etcd` build and its tests against a
# real etcd; a real Prometheus scraping a real
# memnode and computenode under load; the Kubernetes manifests rendered and validated; the
# operator's guide (docs/operations.md) run as written; the container image, and a cluster
# from it driven by redis-cli; then (not with --quick) the verbs suites (transport
# conformance, table suite, end to end) in the Soft-RoCE VM and each fuzz target for a while.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
quick=0
[[ ${1:-} == --quick ]] && quick=1
export CARGO_TERM_COLOR=never
# Disk: a full run with full debug info and incremental caches filled a CI machine's disk
# (15 GiB of target/ by the container step alone). Line tables keep backtraces readable.
export CARGO_INCREMENTAL=0
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
disk_free() { df -h --output=avail "$root" | tail -1 | tr -d ' '; }
started=$(date +%s)
step() { echo; echo "=== $* (+$(( $(date +%s) - started )) s, $(disk_free) disk free)"; }

step "system packages"
if [[ $(id -u) -eq 0 ]]; then ops/install-packages.sh; else ops/install-packages.sh || true; fi

step "rustfmt"
cargo fmt --all -- --check

step "no import cycle between source files"
python3 ops/check-import-cycles.py

step "clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test --workspace"
cargo test --workspace

step "the Redis front end's suites again, on the event-loop io model"
RACEKV_TEST_REDIS_IO=event_loop cargo test -p racekv-redis \
    --test hostile --test tools --test client_lib

step "the README's run command picks the racekv CLI (default-run; dev profile, already built)"
cargo run -q -- --version

step "rdma build (libibverbs; no device needed)"
cargo clippy --workspace --all-targets --features rdma -- -D warnings

step "etcd build (protoc) and the coordinator against a real etcd"
etcd_features=racekv/etcd,racekv-coord/etcd,racekv-coord/testing,racekv-memnode/etcd
cargo clippy -p racekv -p racekv-coord -p racekv-memnode --all-targets --features "$etcd_features" -- -D warnings
# `racekv up --replicas` runs the racekv-memnode beside racekv: built with etcd too.
cargo build -p racekv -p racekv-memnode --features "$etcd_features"
cargo test -p racekv -p racekv-coord -p racekv-memnode --features "$etcd_features" --test etcd --test cluster_etcd --test up_cluster --test faults --test partitions
cargo clippy -p racekv-computenode -p racekv-client --all-targets --features racekv-computenode/etcd,racekv-client/etcd -- -D warnings
cargo test -p racekv-computenode --features racekv-computenode/etcd --test cluster_map --test replication
cargo test -p racekv-client --features racekv-client/etcd --test cluster_map --test snapshot_crash

step "Prometheus smoke test"
ops/prometheus/smoke-test.sh

step "Kubernetes manifests render and validate"
deploy/kubernetes/validate.sh

step "the operator's guide runs"
ops/docs/run-operations-guide.sh

step "container image and a cluster from it"
# The dev-profile binaries the steps above built (stripped in the image), a tag of its own,
# removed again by the cluster test.
ops/container/build.sh --profile debug --tag localhost/racekv:ci
ops/container/cluster-test.sh --image localhost/racekv:ci --remove-image

if [[ $quick -eq 1 ]]; then
    step "quick run: skipped the Soft-RoCE VM suite and fuzzing"
    exit 0
fi

step "verbs suites in the Soft-RoCE VM"
# Only what runs over verbs: the binaries with verbs cases, less their shm, tcp and
# in-process cases (the host ran those above; under TCG they made the run 40 minutes), the
# named ones too (local or tcp only, a minute and a half of emulation).
ops/vm/run-cargo-tests.sh -p racekv-transport -p racekv-hashing \
    --features racekv-transport/rdma,racekv-hashing/rdma \
    --lib --test conformance --test flock --test verbs --test table --test scan --test stalled_read \
    -- --test-threads=1 --skip shm:: --skip tcp:: --skip local:: --skip shm_ --skip tcp_ \
    --skip in_order:: --skip many:: \
    --skip short_lived_clients:: --skip the_item_count_follows --skip fingerprint_collisions \
    --skip colliding_fingerprints --skip a_split_in
# The CLI's end-to-end suite over verbs (its other suites drive the host's racekv binary and
# redis-tools, which the VM does not have).
ops/vm/run-cargo-tests.sh -p racekv --features racekv/rdma --test e2e -- --test-threads=1
# The computenode's pool over verbs (its other suites need redis-tools, which the VM lacks).
ops/vm/run-cargo-tests.sh -p racekv-computenode --features racekv-computenode/rdma --test verbs_pool

step "fuzzing (30 s per target)"
command -v cargo-fuzz > /dev/null || cargo install --locked cargo-fuzz
(
    cd fuzz
    for target in wire_frames stream_frames table_structures flock_messages attach_ring resp_parser http_request auth_handshake table_ops client_ops cluster_map; do
        extra=()
        [[ $target == resp_parser ]] && extra=(-dict=resp.dict -max_len=4096)
        [[ $target == http_request ]] && extra=(-dict=http.dict -max_len=65536)
        RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" -- -max_total_time=30 "${extra[@]}" 2>&1 | tail -3
    done
)

step "all passed"
