"""What applications do with redis-py, default settings (RESP3 since redis-py 8), against one
server. Run against racekv and against a real redis-server as the control: a scenario that
passes on redis-server and fails on racekv is a compatibility bug.

usage: compat.py [HOST:]PORT [SCENARIO ...]   (default: every scenario; host 127.0.0.1)
Prints one line per scenario, `PASS name` or `FAIL name: why`, and exits 1 if any failed.
Keys live under the prefix `compat:py:` and are deleted first.
"""
import json
import sys
import threading
import time
import traceback

import redis

PREFIX = "compat:py:"


def k(name):
    return PREFIX + name


def cache_with_ttls(r):
    # A read-through cache: miss, fill with a TTL, hit; the entry expires on its own.
    assert r.get(k("user:1")) is None
    assert r.set(k("user:1"), json.dumps({"id": 1, "name": "ada"}), ex=60) is True
    assert json.loads(r.get(k("user:1")))["name"] == "ada"
    assert 0 < r.ttl(k("user:1")) <= 60
    assert r.set(k("short"), "x", px=300) is True
    assert r.pttl(k("short")) > 0
    time.sleep(0.6)
    assert r.get(k("short")) is None, "an expired entry was returned"
    assert r.exists(k("short")) == 0
    # SET ... NX for a lock with a TTL, GETEX to refresh, PERSIST to keep.
    assert r.set(k("lock"), "owner-1", nx=True, ex=30) is True
    assert r.set(k("lock"), "owner-2", nx=True, ex=30) is None
    assert r.getex(k("lock"), ex=120) == b"owner-1"
    assert r.ttl(k("lock")) > 60
    assert r.persist(k("lock")) is True
    assert r.ttl(k("lock")) == -1


def session_store(r):
    # Sessions as JSON strings with a sliding expiry.
    sid = k("session:abc")
    r.setex(sid, 1800, json.dumps({"user": 7, "cart": [1, 2]}))
    data = json.loads(r.get(sid))
    data["cart"].append(3)
    assert r.set(sid, json.dumps(data), keepttl=True) is True
    assert r.ttl(sid) > 1700
    assert r.expire(sid, 3600, gt=True) is True
    assert r.expire(sid, 10, gt=True) is False
    assert json.loads(r.getdel(sid))["cart"] == [1, 2, 3]
    assert r.get(sid) is None


def rate_limiter(r):
    # Fixed window: INCR + EXPIRE in one pipeline (MULTI/EXEC is not used here).
    key = k("rate:1.2.3.4")
    counts = []
    for _ in range(5):
        with r.pipeline(transaction=False) as p:
            p.incr(key)
            p.expire(key, 60, nx=True)
            count, _ = p.execute()
        counts.append(count)
    assert counts == [1, 2, 3, 4, 5], counts
    assert 0 < r.ttl(key) <= 60
    assert r.incrby(key, 10) == 15
    assert float(r.incrbyfloat(key, 0.5)) == 15.5


def bulk_mget_mset(r):
    pairs = {k(f"bulk:{i}"): f"value-{i}" for i in range(500)}
    assert r.mset(pairs) is True
    got = r.mget(list(pairs) + [k("bulk:missing")])
    assert got[:500] == [v.encode() for v in pairs.values()]
    assert got[500] is None
    assert r.delete(*pairs) == 500


def scan_iteration(r):
    keys = {k(f"scan:{i}") for i in range(300)}
    with r.pipeline(transaction=False) as p:
        for key in keys:
            p.set(key, "1")
        p.execute()
    seen = {key.decode() for key in r.scan_iter(match=k("scan:*"), count=50)}
    assert seen == keys, f"{len(seen)} of {len(keys)}"
    assert sorted(x.decode() for x in r.keys(k("scan:1?"))) == sorted(k(f"scan:1{d}") for d in range(10))
    assert r.type(k("scan:0")) == b"string"
    assert r.unlink(*keys) == 300


def binary_keys_and_values(r):
    key = (PREFIX + "bin:").encode() + bytes(range(256))
    value = bytes(reversed(range(256))) * 4 + b"\x00\r\n"
    assert r.set(key, value) is True
    assert r.get(key) == value
    assert r.strlen(key) == len(value)
    assert r.append(key, b"\xff") == len(value) + 1
    assert r.getrange(key, -2, -1) == b"\n\xff"
    assert r.delete(key) == 1


def large_values(r):
    # A 17 KB JSON document, 1 MiB and 100 MiB values: byte-exact, with STRLEN and GETRANGE.
    doc = json.dumps({"items": ["x" * 100] * 170}).encode()
    assert len(doc) > 17_000
    assert r.set(k("doc"), doc) is True
    assert r.get(k("doc")) == doc
    for size in (1 << 20, 100 << 20):
        value = bytes(range(256)) * (size // 256)
        assert r.set(k("big"), value) is True
        got = r.get(k("big"))
        assert got == value, f"{size} B came back as {len(got or b'')} B"
        assert r.strlen(k("big")) == size
        assert r.getrange(k("big"), size // 2, size // 2 + 3) == value[size // 2 : size // 2 + 4]
        del got, value
    assert r.delete(k("big"), k("doc")) == 2


def long_keys(r):
    # Keys of 100 KB and 2 MiB (a document's hash as its own key, a cache keyed by a query):
    # byte-exact with their values, a TTL, EXISTS, found by SCAN MATCH, deleted.
    for size in (100_000, 2 << 20):
        key = (PREFIX + "long:").encode() + bytes(range(256)) * (size // 256)
        other = key[:-1] + b"\x00"  # same length, differs only at the end
        assert r.set(key, b"v" * 1000, ex=600) is True
        assert r.get(key) == b"v" * 1000
        assert r.get(other) is None
        assert r.exists(key, other) == 1
        assert 0 < r.ttl(key) <= 600
        found = list(r.scan_iter(match=PREFIX + "long:*", count=1000))
        assert found == [key], f"SCAN found {len(found)} keys of {[len(f) for f in found]} B"
        assert r.delete(key) == 1
        assert r.exists(key) == 0


def transaction_pipeline(r):
    # pipeline() is MULTI/EXEC by default: every reply comes back at EXEC, in order, and
    # later commands see earlier ones' writes.
    with r.pipeline() as p:
        p.set(k("tx:a"), 1)
        p.incr(k("tx:a"))
        p.get(k("tx:a"))
        p.mset({k("tx:b"): "x", k("tx:c"): "y"})
        p.set(k("tx:b"), "z", nx=True, get=True)
        p.rename(k("tx:c"), k("tx:d"))
        assert p.execute() == [True, 2, b"2", True, b"x", True]
    assert r.mget(k("tx:b"), k("tx:c"), k("tx:d")) == [b"x", None, b"y"]
    # A command that fails when EXEC runs it is one error among the replies; the rest apply.
    with r.pipeline() as p:
        p.set(k("tx:s"), "text")
        p.incr(k("tx:s"))
        p.set(k("tx:after"), "1")
        res = p.execute(raise_on_error=False)
    assert res[0] is True and isinstance(res[1], redis.ResponseError) and res[2] is True, res
    assert r.get(k("tx:after")) == b"1"
    # A command refused while queued discards the whole transaction (EXECABORT).
    with r.pipeline() as p:
        p.set(k("tx:never"), "1")
        p.execute_command("NOSUCHCOMMAND")
        try:
            p.execute()
            raise AssertionError("EXEC ran a transaction with an unknown command")
        except redis.ResponseError:
            pass
    assert r.get(k("tx:never")) is None
    # Atomic multi-key commands outside transactions.
    assert r.msetnx({k("tx:n1"): "1", k("tx:n2"): "2"}) is True
    assert r.msetnx({k("tx:n2"): "x", k("tx:n3"): "3"}) is False
    assert r.get(k("tx:n3")) is None
    assert r.set(k("tx:ttl"), "v", ex=100) is True
    assert r.rename(k("tx:ttl"), k("tx:ttl2")) is True
    assert 0 < r.ttl(k("tx:ttl2")) <= 100
    assert r.copy(k("tx:ttl2"), k("tx:ttl3")) is True
    assert r.copy(k("tx:ttl2"), k("tx:ttl3")) is False
    assert r.renamenx(k("tx:ttl2"), k("tx:ttl3")) is False


def watch_conflict(r):
    # Optimistic locking: WATCH, read, MULTI, write, EXEC; another client's write in
    # between makes EXEC fail (WatchError) and nothing applies.
    key = k("tx:balance")
    r.set(key, 100)
    other = redis.Redis(**{n: r.connection_pool.connection_kwargs[n] for n in ("host", "port")})
    with r.pipeline() as p:
        p.watch(key)
        balance = int(p.get(key))
        other.incrby(key, 5)
        p.multi()
        p.set(key, balance - 10)
        p.set(k("tx:log"), "withdrew 10")
        try:
            p.execute()
            raise AssertionError("EXEC applied over another client's write")
        except redis.WatchError:
            pass
    assert int(r.get(key)) == 105 and r.get(k("tx:log")) is None
    # UNWATCH (reset) forgets the watch: the next transaction applies.
    with r.pipeline() as p:
        p.watch(key)
        other.incrby(key, 1)
        p.unwatch()
        p.multi()
        p.incrby(key, -6)
        assert p.execute() == [100]

    # r.transaction() retries on WatchError: concurrent withdrawals never lose an update.
    def withdraw(pipe):
        current = int(pipe.get(key))
        pipe.multi()
        pipe.set(key, current - 1)

    def worker():
        mine = redis.Redis(**{n: r.connection_pool.connection_kwargs[n] for n in ("host", "port")})
        for _ in range(20):
            mine.transaction(withdraw, key)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(r.get(key)) == 100 - 80, r.get(key)


SCENARIOS = [
    cache_with_ttls,
    session_store,
    rate_limiter,
    bulk_mget_mset,
    scan_iteration,
    binary_keys_and_values,
    large_values,
    long_keys,
    transaction_pipeline,
    watch_conflict,
]


def main():
    host, _, port = sys.argv[1].rpartition(":")
    wanted = set(sys.argv[2:])
    r = redis.Redis(host=host or "127.0.0.1", port=int(port))
    for key in r.scan_iter(match=PREFIX + "*", count=1000):
        r.delete(key)
    failed = 0
    for scenario in SCENARIOS:
        if wanted and scenario.__name__ not in wanted:
            continue
        try:
            scenario(r)
            print(f"PASS {scenario.__name__}")
        except Exception as e:  # noqa: BLE001 - every failure is reported the same way
            failed += 1
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(f"FAIL {scenario.__name__}: {type(e).__name__} {e} (line {where.lineno})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
