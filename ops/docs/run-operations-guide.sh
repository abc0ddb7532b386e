#!/usr/bin/env bash
# Runs docs/operations.md, the operator's guide, as CI does (a step of ops/test.sh):
#
#   ops/docs/run-operations-guide.sh [GUIDE]        default docs/operations.md
#
# Every fenced shell block (sh, bash, shell, console) of the guide carries, on the line just
# before its fence, either `<!-- ci: run -->` or `<!-- ci: covered by REF -->`:
#  - the `ci: run` blocks run in order in ONE bash session (`set -euo pipefail`), in a fresh
#    temporary directory, with the built binaries first on PATH, so the guide says
#    `racekv-memnode ...` as an operator would; any failing block fails the run;
#  - a `covered by` REF names the test or CI script that does what the block does: `FILE`
#    (must exist) or `FILE::NAME` (FILE must define `fn NAME`). ops/container/cluster-test.sh
#    and deploy/kubernetes/validate.sh are being added on other branches: while missing, they
#    only draw a warning;
#  - a shell block without an annotation, an annotation no block follows, or a fence with no
#    language fails the run, and so do run blocks shellcheck faults (where it is installed).
# Daemons the blocks start in the background are killed (by pid) when the session ends, and
# the temporary directory is removed. Ports: 27400-27499 on loopback.
#
# Needs: redis-tools, curl, etcd (etcd-server), and racekv built with etcd (cargo build
# --workspace --bins --features racekv/etcd, done here when RACEKV_BIN_DIR is not set: the
# build ops/prometheus/smoke-test.sh makes just before in ops/test.sh; RACEKV_BIN_DIR
# overrides where the binaries are).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
guide=${1:-$root/docs/operations.md}
if [ -z "${RACEKV_BIN_DIR:-}" ]; then
    (cd "$root" && cargo build -q --workspace --bins --features racekv/etcd)
fi
bin=$(cd "${RACEKV_BIN_DIR:-$root/target/debug}" && pwd)
for b in racekv racekv-memnode racekv-computenode; do
    [ -x "$bin/$b" ] || { echo "run-operations-guide: $bin/$b is missing (cargo build --workspace --bins)" >&2; exit 1; }
done
# References that other branches are adding: a warning, not a failure, until they land.
pending="ops/container/cluster-test.sh deploy/kubernetes/validate.sh"

work=$(mktemp -d)
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
started=$(date +%s)

# 1. Extract: the run blocks become one script; the covered-by references a list; problems
#    a list (line numbers are the guide's).
awk -v script="$work/guide.sh" -v refs="$work/refs" -v problems="$work/problems" '
    function is_shell(lang) { return lang == "sh" || lang == "bash" || lang == "shell" || lang == "console" }
    BEGIN { inside = 0; pending_note = "" }
    !inside && /^[ \t]*```/ {
        lang = $0; sub(/^[ \t]*```[ \t]*/, "", lang); sub(/[ \t].*$/, "", lang)
        inside = 1; start = NR; mode = ""
        if (lang == "") {
            print "line " NR ": a fence with no language (say sh, toml, text, ...)" > problems
        } else if (is_shell(lang)) {
            if (prev ~ /^<!-- ci: run -->$/) {
                mode = "run"; blocks++
                printf "\n__guide_block %d %d\n", blocks, NR > script
            } else if (prev ~ /^<!-- ci: covered by [^ ]+ -->$/) {
                ref = prev; sub(/^<!-- ci: covered by /, "", ref); sub(/ -->$/, "", ref)
                print NR, ref > refs
            } else {
                print "line " NR ": a " lang " block without <!-- ci: run --> or <!-- ci: covered by REF --> on the line before it" > problems
            }
        } else if (prev ~ /^<!-- ci:/) {
            print "line " NR ": a ci annotation on a " lang " block (only shell blocks are run or covered)" > problems
        }
        prev = $0; next
    }
    inside && /^[ \t]*```[ \t]*$/ { inside = 0; prev = $0; next }
    inside { if (mode == "run") print > script; prev = $0; next }
    {
        if (prev ~ /^<!-- ci:/ && prev != "") {
            print "line " NR - 1 ": a ci annotation with no fenced block on the next line" > problems
        }
        if ($0 ~ /^<!-- ci:/ && $0 !~ /^<!-- ci: (run|covered by [^ ]+) -->$/) {
            print "line " NR ": a malformed ci annotation: " $0 > problems
        }
        prev = $0
    }
    END {
        if (inside) print "line " start ": a fence that is never closed" > problems
        if (blocks == 0) print "no <!-- ci: run --> block at all" > problems
    }
' "$guide"
touch "$work/refs" "$work/problems"
if [ -s "$work/problems" ]; then
    echo "run-operations-guide: $guide:" >&2
    cat "$work/problems" >&2
    exit 1
fi

# 2. Every covered-by reference names something that exists.
bad=0
covered=0
missing=0
while read -r line ref; do
    file=${ref%%::*}
    name=
    [ "$file" != "$ref" ] && name=${ref#*::}
    if [ ! -e "$root/$file" ]; then
        if [ -z "$name" ] && [[ " $pending " == *" $file "* ]]; then
            echo "warning: line $line: $file does not exist yet (being added on another branch)" >&2
            missing=$((missing + 1))
            continue
        fi
        echo "line $line: covered by $ref: $file does not exist" >&2
        bad=1
    elif [ -n "$name" ] && ! grep -qE "fn ${name}[[:space:]]*(<|\()" "$root/$file"; then
        echo "line $line: covered by $ref: no fn $name in $file" >&2
        bad=1
    else
        covered=$((covered + 1))
    fi
done < "$work/refs"
[ $bad -eq 0 ] || { echo "run-operations-guide: a covered-by reference is broken" >&2; exit 1; }

# 3. The blocks are clean shell (where shellcheck is installed), then run in one session, in
#    a directory of their own.
if command -v shellcheck > /dev/null; then
    { echo '#!/usr/bin/env bash'; cat "$work/guide.sh"; } > "$work/check.sh"
    shellcheck -s bash "$work/check.sh" || { echo "run-operations-guide: shellcheck finds fault with the run blocks (line numbers: the extracted script's)" >&2; exit 1; }
fi
mkdir "$work/session"
{
    cat <<'EOF'
set -euo pipefail
__guide_block() { __block=$1; __line=$2; echo "--- block $1 (line $2) +$(( $(date +%s) - __started )) s"; }
__guide_cleanup() {
    local status=$? pid
    trap - EXIT
    [ $status -eq 0 ] || echo "run-operations-guide: block $__block (the guide's line $__line) failed with status $status" >&2
    for pid in $(jobs -p); do kill "$pid" 2> /dev/null || true; done
    wait 2> /dev/null || true
    exit $status
}
trap __guide_cleanup EXIT
trap 'exit 143' TERM INT
__block=0 __line=0 __started=$(date +%s)
EOF
    cat "$work/guide.sh"
} > "$work/session.sh"
status=0
(cd "$work/session" && PATH="$bin:$PATH" timeout 300 bash "$work/session.sh") || status=$?
if [ $status -ne 0 ]; then
    echo "run-operations-guide: FAILED (status $status); daemon logs:" >&2
    for log in "$work"/session/*.err; do
        [ -e "$log" ] || continue
        echo "== ${log##*/}" >&2
        # A panic's message and place, then the log's end.
        grep -A2 "panicked at" "$log" >&2 || true
        tail -5 "$log" >&2
    done
    exit 1
fi
echo "the operator's guide ran: $(grep -c '^__guide_block' "$work/guide.sh") blocks run, $covered covered by tests or CI scripts ($missing by scripts not there yet), in $(( $(date +%s) - started )) s"
