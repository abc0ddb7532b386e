#!/usr/bin/env bash
# A real Prometheus against a real memnode and computenode under load, and a failover
# checker (`racekv cluster manage`) on a real etcd:
#  1. promtool checks the scrape config and the alert/recording rules;
#  2. every racekv metric the rules and dashboards/ use is exported by the running daemons;
#  3. load through every front end (embedded, attached, remote, Redis), an error reply, the
#     region filled until OOM, a garbage frame: what the dashboards and alerts watch;
#  4. Prometheus scrapes both, loads the rules healthy, and every dashboard panel and rule
#     expression returns data (check-queries.py).
# Needs: the `prometheus` and `etcd-server` Debian packages, redis-tools, and racekv built
# with etcd (cargo build --features racekv/etcd; RACEKV_BIN_DIR overrides where the
# binaries are).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
if [ -z "${RACEKV_BIN_DIR:-}" ]; then
    (cd "$root" && cargo build -q --workspace --bins --features racekv/etcd)
fi
bin=${RACEKV_BIN_DIR:-$root/target/debug}
# shellcheck source=ops/lib.sh
source "$root/ops/lib.sh"
racekv_work_dir
fail() { echo "prometheus smoke test FAILED: $*" >&2; exit 1; }
ready() { # file, what
    for _ in $(seq 200); do grep -q '^READY' "$1" && return 0; sleep 0.1; done
    fail "$2 did not start: $(cat "${1%.out}.err")"
}

mem_port=17411 mem_metrics=19411 redis_port=17412 remote_port=17413 node_metrics=19412 prom_port=19091
etcd_port=17414 etcd_peer_port=17415 cluster_metrics=19413
token=smoke-test-token
cp "$root/ops/prometheus/racekv-rules.yml" "$work/"
sed "s/127.0.0.1:9400/127.0.0.1:$mem_metrics/; s/127.0.0.1:9401/127.0.0.1:$node_metrics/; s/127.0.0.1:9402/127.0.0.1:$cluster_metrics/; s/scrape_interval: 5s/scrape_interval: 1s/; s/evaluation_interval: 15s/evaluation_interval: 1s/" \
    "$root/ops/prometheus/prometheus.yml" > "$work/prometheus.yml"
promtool check rules "$work/racekv-rules.yml"
promtool check config "$work/prometheus.yml"

RACEKV_MEMNODE_TOKEN=$token RACEKV_MEMNODE_SYNC_INTERVAL_MS=200 "$bin/racekv-memnode" \
    --listen-tcp "127.0.0.1:$mem_port" --listen-shm none --metrics-addr "127.0.0.1:$mem_metrics" \
    --data-file "$work/region" --region-bytes 48MiB --groups-per-subtable 4 --chunk-bytes 64KiB \
    > "$work/memnode.out" 2> "$work/memnode.err" &
pids+=($!)
ready "$work/memnode.out" memnode
RACEKV_COMPUTENODE_TOKEN=$token "$bin/racekv-computenode" --memnodes "tcp:127.0.0.1:$mem_port" \
    --redis-addr "127.0.0.1:$redis_port" --remote-addr "127.0.0.1:$remote_port" \
    --attach-socket "$work/attach.sock" --metrics-addr "127.0.0.1:$node_metrics" \
    > "$work/computenode.out" 2> "$work/computenode.err" &
pids+=($!)
ready "$work/computenode.out" computenode

etcd --name smoke --data-dir "$work/etcd" --log-level error \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "smoke=http://127.0.0.1:$etcd_peer_port" > "$work/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$etcd_port/health" > /dev/null && break; sleep 0.1; done
"$bin/racekv" cluster manage --etcd "http://127.0.0.1:$etcd_port" --metrics-addr "127.0.0.1:$cluster_metrics" \
    --check-interval-ms 200 > "$work/manage.out" 2> "$work/manage.err" &
pids+=($!)
ready "$work/manage.out" "failover checker (racekv cluster manage)"

prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
    --web.listen-address="127.0.0.1:$prom_port" > "$work/prometheus.log" 2>&1 &
pids+=($!)

# Load, through every way in.
keys=100
for i in $(seq $keys); do RACEKV_TOKEN=$token "$bin/racekv" put --memnode "tcp:127.0.0.1:$mem_port" "key-$i" "value-$i" > /dev/null; done
[ "$(RACEKV_TOKEN=$token "$bin/racekv" get --memnode "tcp:127.0.0.1:$mem_port" key-7)" = "value-7" ] || fail "embedded read back failed"
[ "$("$bin/racekv" get --attach "$work/attach.sock" key-8)" = "value-8" ] || fail "attached read back failed"
[ "$("$bin/racekv" get --remote "127.0.0.1:$remote_port" key-9)" = "value-9" ] || fail "remote read back failed"
redis-benchmark -p "$redis_port" -t set,get,incr -n 20000 -c 8 -P 4 -r 5000 -q > /dev/null
# A transaction (MULTI/EXEC on the table's atomic commit).
printf 'MULTI\nSET tx-a 1\nINCR tx-a\nEXEC\n' | redis-cli -p "$redis_port" | tail -1 | grep -qx 2 || fail "MULTI/EXEC did not run"
redis-cli -p "$redis_port" set not-a-number x > /dev/null
redis-cli -p "$redis_port" incr not-a-number | grep -q "not an integer" || fail "INCR of text did not fail"
# Fill the region until writes answer OOM (a 48 MiB region, 1 MiB values).
head -c 1048576 /dev/zero | tr '\0' v > "$work/mib"
oom=0
for i in $(seq 100); do
    if redis-cli -p "$redis_port" -x set "big-$i" < "$work/mib" | grep -q OOM; then oom=1; break; fi
done
[ $oom -eq 1 ] || fail "100 MiB of values never filled a 48 MiB region"
# A frame no client sends: the memnode closes that connection and counts it.
printf 'GET / HTTP/1.0\r\n\r\n' | timeout 5 bash -c "cat > /dev/tcp/127.0.0.1/$mem_port" || true
sleep 1.5 # a housekeeping round

curl -sf "http://127.0.0.1:$mem_metrics/metrics" > "$work/metrics.txt" || fail "no memnode /metrics"
curl -sf "http://127.0.0.1:$node_metrics/metrics" >> "$work/metrics.txt" || fail "no computenode /metrics"
curl -sf "http://127.0.0.1:$cluster_metrics/metrics" >> "$work/metrics.txt" || fail "no failover checker /metrics"
used=$(grep -ohE '(racekv|process)_[a-z0-9_]+' "$root/ops/prometheus/racekv-rules.yml" "$root"/dashboards/*.json \
    | sed -E 's/_(bucket|sum|count)$//' | grep -v '_$' | sort -u)
missing=0
for name in $used; do
    if ! grep -qE "^${name}(_bucket|_sum|_count)?(\{| )" "$work/metrics.txt"; then
        echo "metric $name is used by rules or dashboards but not exported" >&2
        missing=1
    fi
done
[ $missing -eq 0 ] || fail "unknown metrics referenced"
echo "all $(echo "$used" | wc -w) referenced metrics are exported"

query() { curl -sf --get "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$1"; }
count() { query "$1" 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["data"]["result"]))' 2>/dev/null || echo 0; }
# Rates need two scrapes after the load; wait until both targets are up and OOMs are seen.
for _ in $(seq 120); do
    [ "$(count 'up == 1')" = 3 ] && [ "$(count 'rate(racekv_redis_error_replies_total{code="OOM"}[1m]) > 0')" = 1 ] && break
    sleep 0.5
done
[ "$(count 'up == 1')" = 3 ] || fail "not all three targets are up; log: $(tail -5 "$work/prometheus.log")"
items=$(query 'racekv_memnode_items' | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"]["result"][0]["value"][1])')
[ "$items" -ge "$keys" ] || fail "Prometheus saw $items keys, not $keys or more"
echo "Prometheus scraped racekv_memnode_items = $items"
# Panels show rates over the last minute: load again, then let two scrapes see it.
redis-benchmark -p "$redis_port" -t get,incr -n 5000 -c 8 -P 4 -r 5000 -q > /dev/null
"$bin/racekv" get --attach "$work/attach.sock" key-10 > /dev/null
"$bin/racekv" get --remote "127.0.0.1:$remote_port" key-11 > /dev/null
sleep 3
curl -sf "http://127.0.0.1:$prom_port/api/v1/rules" | python3 -c '
import json, sys
groups = json.load(sys.stdin)["data"]["groups"]
rules = [r for g in groups if g["name"].startswith("racekv-") for r in g["rules"]]
assert len({g["name"] for g in groups}) == 3, "all three rule groups loaded"
bad = [r["name"] for r in rules if r.get("health") not in ("ok", "unknown")]
assert not bad, f"unhealthy rules: {bad}"
print(f"{len(rules)} racekv rules loaded and healthy")
'
python3 "$root/ops/prometheus/check-queries.py" "http://127.0.0.1:$prom_port" "$work/racekv-rules.yml" "$root"/dashboards/*.json
echo "prometheus smoke test passed"
