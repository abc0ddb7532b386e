#!/usr/bin/env bash
# A real Prometheus against a real memnode:
#  1. promtool checks the scrape config and the alert/recording rules;
#  2. every racekv metric the rules and dashboards/ use is exported by a running memnode;
#  3. Prometheus scrapes the memnode, sees the keys written, and loads the rules healthy.
# Needs: the `prometheus` Debian package, and racekv built (cargo build; RACEKV_BIN_DIR
# overrides where the binaries are).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
if [ -z "${RACEKV_BIN_DIR:-}" ]; then
    (cd "$root" && cargo build -q --workspace --bins)
fi
bin=${RACEKV_BIN_DIR:-$root/target/debug}
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "prometheus smoke test FAILED: $*" >&2; exit 1; }

mem_port=17411 metrics_port=19411 prom_port=19091
cp "$root/ops/prometheus/racekv-rules.yml" "$work/"
sed "s/127.0.0.1:9400/127.0.0.1:$metrics_port/; s/scrape_interval: 5s/scrape_interval: 1s/; s/evaluation_interval: 15s/evaluation_interval: 1s/" \
    "$root/ops/prometheus/prometheus.yml" > "$work/prometheus.yml"
promtool check rules "$work/racekv-rules.yml"
promtool check config "$work/prometheus.yml"

"$bin/racekv-memnode" --listen-tcp "127.0.0.1:$mem_port" --metrics-addr "127.0.0.1:$metrics_port" \
    --region-bytes 64MiB --groups-per-subtable 4 > "$work/memnode.out" 2> "$work/memnode.err" &
pids+=($!)
for _ in $(seq 100); do grep -q '^READY' "$work/memnode.out" && break; sleep 0.1; done
grep -q '^READY' "$work/memnode.out" || fail "memnode did not start: $(cat "$work/memnode.err")"

export RACEKV_MEMNODES="tcp:127.0.0.1:$mem_port"
keys=300
for i in $(seq $keys); do "$bin/racekv" put "key-$i" "value-$i" > /dev/null; done
[ "$("$bin/racekv" get key-7)" = "value-7" ] || fail "read back failed"
sleep 1.5 # one housekeeping round

curl -sf "http://127.0.0.1:$metrics_port/metrics" > "$work/metrics.txt" || fail "no /metrics"
used=$(grep -ohE 'racekv_[a-z0-9_]+' "$root/ops/prometheus/racekv-rules.yml" "$root"/dashboards/*.json \
    | sed -E 's/_(bucket|sum|count)$//' | grep -v '^racekv_$' | sort -u)
missing=0
for name in $used; do
    case "$name" in racekv_[a-z]*:*) continue ;; esac
    if ! grep -qE "^${name}(_bucket|_sum|_count)?(\{| )" "$work/metrics.txt"; then
        echo "metric $name is used by rules or dashboards but not exported" >&2
        missing=1
    fi
done
[ $missing -eq 0 ] || fail "unknown metrics referenced"
echo "all $(echo "$used" | wc -w) referenced metrics are exported"

prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
    --web.listen-address="127.0.0.1:$prom_port" > "$work/prometheus.log" 2>&1 &
pids+=($!)
query() { curl -sf --get "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$1"; }
seen=""
for _ in $(seq 120); do
    seen=$(query 'racekv_memnode_items' 2>/dev/null | python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")' 2>/dev/null || true)
    [ -n "$seen" ] && [ "$seen" -ge "$keys" ] && break
    sleep 0.5
done
[ -n "$seen" ] && [ "$seen" -ge "$keys" ] || fail "Prometheus never saw $keys keys (last: '$seen'); log: $(tail -5 "$work/prometheus.log")"
echo "Prometheus scraped racekv_memnode_items = $seen"
up=$(query 'up{job="racekv-memnode"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"]["result"][0]["value"][1])')
[ "$up" = "1" ] || fail "scrape target is down"
curl -sf "http://127.0.0.1:$prom_port/api/v1/rules" | python3 -c '
import json, sys
groups = json.load(sys.stdin)["data"]["groups"]
rules = [r for g in groups if g["name"] == "racekv-memnode" for r in g["rules"]]
assert rules, "racekv rules not loaded"
bad = [r["name"] for r in rules if r.get("health") not in ("ok", "unknown")]
assert not bad, f"unhealthy rules: {bad}"
print(f"{len(rules)} racekv rules loaded and healthy")
'
echo "prometheus smoke test passed"
