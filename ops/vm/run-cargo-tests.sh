#!/usr/bin/env bash
# Builds the test binaries of a `cargo test` invocation (without running them) and runs every
# one in the Soft-RoCE VM with the same arguments.
#
# usage: ops/vm/run-cargo-tests.sh [CARGO TEST ARGS...] [-- TEST BINARY ARGS...]
#   e.g. ops/vm/run-cargo-tests.sh -p racekv-transport --features rdma -- --test-threads=2
# With no arguments it runs the transport crate's tests with feature rdma, one test at a time
# (the conformance suite on shm, tcp and verbs, plus the verbs-only tests).
# run-tests.sh options can be passed through RACEKV_VM_OPTS (e.g. "--timeout 1800").
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

cargo_args=()
while [[ $# -gt 0 && $1 != -- ]]; do
    cargo_args+=("$1")
    shift
done
[[ $# -gt 0 ]] && shift
test_args=("$@")
if [[ ${#cargo_args[@]} -eq 0 ]]; then
    cargo_args=(-p racekv-transport --features rdma)
    # One test at a time: under TCG, parallel tests make the tcp suite's 16 MiB requests miss
    # their 5 s timeout (an emulation artifact; on the host they take well under a second).
    [[ ${#test_args[@]} -gt 0 ]] || test_args=(--test-threads=1)
fi

json=$(mktemp)
trap 'rm -f "$json"' EXIT
echo "run-cargo-tests: cargo test --no-run ${cargo_args[*]}"
build_started=$(date +%s)
(cd "$root" && cargo test --no-run --message-format=json "${cargo_args[@]}") >"$json"
echo "run-cargo-tests: built in $(( $(date +%s) - build_started )) s"

# Test executables: compiler artifacts built in the test profile with a non-null
# "executable" (not the package's own binaries, which cargo also builds for integration tests;
# their *target* also says "test":true, so match the profile's flag).
mapfile -t binaries < <(grep '"reason":"compiler-artifact"' "$json" | grep '"profile":{[^}]*"test":true' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | sort -u)
[[ ${#binaries[@]} -gt 0 ]] || { echo "run-cargo-tests: cargo built no test binary" >&2; exit 2; }

spec=()
for b in "${binaries[@]}"; do
    [[ ${#spec[@]} -gt 0 ]] && spec+=(---)
    spec+=("$b" "${test_args[@]+"${test_args[@]}"}")
done
# shellcheck disable=SC2086
exec "$here/run-tests.sh" ${RACEKV_VM_OPTS:-} "${spec[@]}"
