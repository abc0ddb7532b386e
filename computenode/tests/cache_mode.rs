//! Cache mode through a real computenode's front ends over a real memnode (shm): Redis'
//! `maxmemory` with each implemented policy, the OOM replies, `CONFIG GET/SET` and the
//! INFO counters; the library's writes through the attach and remote front ends.

use std::time::Duration;

mod common;

use racekv_client::{Client, ClientError};
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::eviction::OVER_LIMIT_REASON;
use racekv_computenode::Computenode;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_redis::maxmemory::Limit;
use racekv_transport::TransportKind;

const LIMIT: u64 = 1 << 20;
const VALUE: [u8; 2000] = [7u8; 2000];

/// A memnode of 32 MiB and a computenode serving Redis on it, with `maxmemory` 1 MiB.
fn cache(policy: &str) -> (TestMemnode, Computenode, redis::Connection) {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 32 << 20, 16);
    let node = common::redis_only(&[&m], |c| {
        // Few chunks held ahead: the heap's footprint then tracks the data.
        c.ready_sessions = 2;
        c.prefetch_chunks = 1;
        c.maxmemory = Limit::Bytes(LIMIT);
        c.maxmemory_policy = policy.into();
    });
    let port = node.redis_addr().unwrap().port();
    let conn = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap().get_connection().unwrap();
    (m, node, conn)
}

fn info_field(conn: &mut redis::Connection, field: &str) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(conn).unwrap();
    let line = info.lines().find(|l| l.starts_with(&format!("{field}:"))).unwrap_or_else(|| panic!("{info}"));
    line.split_once(':').unwrap().1.trim().parse().unwrap()
}

fn set(conn: &mut redis::Connection, key: &str, ex: Option<u64>) -> redis::RedisResult<()> {
    let mut cmd = redis::cmd("SET");
    cmd.arg(key).arg(&VALUE[..]);
    if let Some(secs) = ex {
        cmd.arg("EX").arg(secs);
    }
    cmd.query(conn)
}

/// 10x maxmemory written with allkeys-random: no SET fails, the memnode's data and heap
/// stay near the limit, and the evicted keys are misses.
#[test]
fn allkeys_random_never_fails_a_set_and_stays_near_the_limit() {
    let (m, node, mut conn) = cache("allkeys-random");
    let evicted_before = info_field(&mut conn, "evicted_keys");
    let keys = (10 * LIMIT / VALUE.len() as u64) as usize;
    for i in 0..keys {
        set(&mut conn, &format!("key:{i}"), None).unwrap_or_else(|e| panic!("SET {i} of {keys}: {e}"));
    }
    std::thread::sleep(Duration::from_millis(300)); // a refresh or two
    let used = node.status().memnodes[0].used_bytes;
    let footprint = m.stats().heap.heap_used_bytes;
    eprintln!("{keys} keys written: estimated live data {used} B, heap footprint {footprint} B");
    assert!(used <= LIMIT + LIMIT / 4, "estimated live data {used} B, limit {LIMIT} B");
    assert!(footprint <= 2 * LIMIT, "the memnode's heap holds {footprint} B, limit {LIMIT} B");
    let live: u64 = redis::cmd("DBSIZE").query(&mut conn).unwrap();
    assert!(live > 0 && live < keys as u64 / 5, "{live} of {keys} keys left");
    let evicted = info_field(&mut conn, "evicted_keys") - evicted_before;
    assert!(evicted >= keys as u64 - live, "evicted {evicted}, {live} of {keys} left");
    let misses = info_field(&mut conn, "keyspace_misses");
    let mut missing = 0;
    for i in 0..keys / 10 {
        let v: Option<Vec<u8>> = redis::cmd("GET").arg(format!("key:{i}")).query(&mut conn).unwrap();
        missing += usize::from(v.is_none());
    }
    assert!(missing > keys / 20, "only {missing} of the first {} keys were evicted", keys / 10);
    assert_eq!(info_field(&mut conn, "keyspace_misses") - misses, missing as u64);
    let last: Option<Vec<u8>> = redis::cmd("GET").arg(format!("key:{}", keys - 1)).query(&mut conn).unwrap();
    assert_eq!(last.as_deref(), Some(&VALUE[..]), "the last key written is there: its room was made first");
    // The Prometheus counters, in base units (this process's: every test's node counts).
    let metrics = racekv_telemetry::render();
    for name in ["racekv_evicted_keys_total", "racekv_keyspace_hits_total", "racekv_keyspace_misses_total"] {
        let value =
            metrics.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).unwrap_or_else(|| panic!("{name}"));
        assert!(value.parse::<f64>().unwrap() > 0.0, "{name} {value}");
    }
}

/// Every volatile policy evicts only keys with an expiry; volatile-ttl those expiring
/// soonest; with no volatile key left, a write over the limit gets Redis' OOM.
#[test]
fn volatile_policies_evict_only_keys_with_an_expiry() {
    for policy in ["volatile-random", "volatile-ttl", "volatile-lru", "volatile-lfu"] {
        let (_m, _node, mut conn) = cache(policy);
        let persistent = (LIMIT / 4 / VALUE.len() as u64) as usize;
        for i in 0..persistent {
            set(&mut conn, &format!("p:{i}"), None).unwrap();
        }
        // Expiries spread over [1000 s, 11000 s), in no order.
        let ttl = |i: u64| 1_000 + (i * 7_919) % 10_000;
        let volatile = 10 * persistent as u64;
        for i in 0..volatile {
            set(&mut conn, &format!("v:{i}"), Some(ttl(i))).unwrap_or_else(|e| panic!("{policy}: SET v:{i}: {e}"));
        }
        for i in 0..persistent {
            let exists: bool = redis::cmd("EXISTS").arg(format!("p:{i}")).query(&mut conn).unwrap();
            assert!(exists, "{policy} evicted p:{i}, which has no expiry");
        }
        let survivors: Vec<u64> = (0..volatile)
            .filter(|&i| redis::cmd("EXISTS").arg(format!("v:{i}")).query::<bool>(&mut conn).unwrap())
            .map(ttl)
            .collect();
        assert!(!survivors.is_empty() && survivors.len() < volatile as usize / 2, "{policy}: {}", survivors.len());

        let mean = survivors.iter().sum::<u64>() / survivors.len() as u64;
        eprintln!("{policy}: {} of {volatile} volatile keys left, expiring in {mean} s on average", survivors.len());
        if policy == "volatile-ttl" {
            // Uniform survivors would average 6000 s; the soonest-expiring go first.
            assert!(mean > 7_000, "volatile-ttl left keys expiring in {mean} s on average");
        }
        // Only persistent keys from here: once the volatile ones are gone, OOM.
        let mut oom = None;
        for i in 0..8 * persistent {
            if let Err(e) = set(&mut conn, &format!("q:{i}"), None) {
                oom = Some(e);
                break;
            }
        }
        let e = oom.unwrap_or_else(|| panic!("{policy}: writes over the limit never failed"));
        assert_eq!(e.code(), Some("OOM"), "{policy}: {e}");
        assert!(e.to_string().contains("command not allowed when used memory > 'maxmemory'"), "{e}");
    }
}

/// noeviction answers OOM over the limit; CONFIG SET shows and changes the settings.
#[test]
fn noeviction_answers_oom_and_config_set_switches_policy() {
    let (_m, _node, mut conn) = cache("noeviction");
    let got: Vec<String> = redis::cmd("CONFIG").arg("GET").arg("maxmemory*").query(&mut conn).unwrap();
    assert_eq!(got, ["maxmemory", &LIMIT.to_string(), "maxmemory-policy", "noeviction", "maxmemory-samples", "5"]);
    let mut written = 0;
    let e = loop {
        match set(&mut conn, &format!("k:{written}"), None) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
        assert!(written < 4 * LIMIT as usize / VALUE.len(), "noeviction never refused a write");
    };
    assert_eq!(e.code(), Some("OOM"), "{e}");
    assert!(written as u64 >= LIMIT / 2 / VALUE.len() as u64, "OOM after only {written} keys");
    for policy in ["allkeys-lru", "allkeys-lfu", "volatile-lru", "volatile-lfu"] {
        redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg(policy).query::<()>(&mut conn).unwrap();
        let got: Vec<String> = redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy").query(&mut conn).unwrap();
        assert_eq!(got, ["maxmemory-policy", policy]);
    }
    let lfu: Vec<String> = redis::cmd("CONFIG").arg("GET").arg("lfu-*").query(&mut conn).unwrap();
    assert_eq!(lfu, ["lfu-log-factor", "10", "lfu-decay-time", "1"], "Redis' defaults");
    redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("allkeys-random").query::<()>(&mut conn).unwrap();
    redis::cmd("CONFIG").arg("SET").arg("maxmemory-samples").arg("3").query::<()>(&mut conn).unwrap();
    for i in 0..written {
        set(&mut conn, &format!("more:{i}"), None).unwrap();
    }
    let info: String = redis::cmd("INFO").arg("memory").query(&mut conn).unwrap();
    assert!(info.contains("maxmemory_policy:allkeys-random") && info.contains(&format!("maxmemory:{LIMIT}")), "{info}");
    redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0").query::<()>(&mut conn).unwrap();
    set(&mut conn, "unlimited", None).unwrap();
}

/// `maxmemory` fits this many of the tests' keys (1 MiB of 2 KB values: about 480).
const FITTING: usize = (LIMIT / 2_112) as usize;

/// Keys `prefix:0..n` that exist now.
fn present(conn: &mut redis::Connection, prefix: &str, n: usize) -> usize {
    (0..n).filter(|i| redis::cmd("EXISTS").arg(format!("{prefix}:{i}")).query::<bool>(conn).unwrap()).count()
}

/// allkeys-lfu: keys read often outlive keys written as often but never read. With
/// `lfu-log-factor 0` every read counts and with `lfu-decay-time 0` none decays (a minute
/// boundary during the test would take one off each), so the counters are exact: hot keys
/// read 10 times score 15, the others stay at Redis' initial 5.
#[test]
fn allkeys_lfu_keeps_the_keys_read_most() {
    let (_m, node, mut conn) = cache("allkeys-lfu");
    redis::cmd("CONFIG").arg("SET").arg("lfu-log-factor").arg("0").query::<()>(&mut conn).unwrap();
    redis::cmd("CONFIG").arg("SET").arg("lfu-decay-time").arg("0").query::<()>(&mut conn).unwrap();
    let half = FITTING / 3;
    for i in 0..half {
        set(&mut conn, &format!("hot:{i}"), None).unwrap();
        set(&mut conn, &format!("cold:{i}"), None).unwrap();
    }
    for _ in 0..10 {
        for i in 0..half {
            let _: Option<Vec<u8>> = redis::cmd("GET").arg(format!("hot:{i}")).query(&mut conn).unwrap();
        }
    }
    let freq = |conn: &mut redis::Connection, key: &str| -> u64 {
        redis::cmd("OBJECT").arg("FREQ").arg(key).query(conn).unwrap()
    };
    assert_eq!((freq(&mut conn, "hot:0"), freq(&mut conn, "cold:0")), (15, 5), "OBJECT FREQ: counted, not counting");
    let e = redis::cmd("OBJECT").arg("IDLETIME").arg("hot:0").query::<u64>(&mut conn).unwrap_err();
    assert!(e.to_string().contains("An LRU maxmemory policy is not selected"), "{e}");
    // As much again as fits, never read: they and the cold keys are the candidates.
    for i in 0..FITTING {
        set(&mut conn, &format!("new:{i}"), None).unwrap_or_else(|e| panic!("SET new:{i}: {e}"));
    }
    let (hot, cold) = (present(&mut conn, "hot", half), present(&mut conn, "cold", half));
    let evicted = info_field(&mut conn, "evicted_keys");
    eprintln!("allkeys-lfu: {hot} of {half} hot and {cold} of {half} cold keys left, {evicted} evicted");
    assert!(evicted as usize >= half, "the writes evicted {evicted} keys");
    assert!(hot >= half * 9 / 10, "only {hot} of {half} often-read keys are left ({cold} cold ones)");
    assert!(cold <= half / 2, "{cold} of {half} unread keys outlived the read ones");
    assert!(node.status().memnodes[0].used_bytes <= LIMIT + LIMIT / 4);
}

/// allkeys-lru: keys read since outlive keys unread for longer. The access word keeps
/// seconds, as Redis' LRU clock does, so the phases are a second apart.
#[test]
fn allkeys_lru_evicts_the_keys_unread_longest() {
    let (_m, _node, mut conn) = cache("allkeys-lru");
    let half = FITTING / 3;
    for i in 0..half {
        set(&mut conn, &format!("old:{i}"), None).unwrap();
        set(&mut conn, &format!("read:{i}"), None).unwrap();
    }
    std::thread::sleep(Duration::from_millis(2_100));
    for i in 0..half {
        let _: Option<Vec<u8>> = redis::cmd("GET").arg(format!("read:{i}")).query(&mut conn).unwrap();
    }
    std::thread::sleep(Duration::from_millis(1_100));
    let idle = |conn: &mut redis::Connection, key: &str| -> u64 {
        redis::cmd("OBJECT").arg("IDLETIME").arg(key).query(conn).unwrap()
    };
    let (old_idle, read_idle) = (idle(&mut conn, "old:0"), idle(&mut conn, "read:0"));
    assert!(old_idle >= 3 && read_idle >= 1 && old_idle > read_idle, "OBJECT IDLETIME {old_idle} and {read_idle}");
    let e = redis::cmd("OBJECT").arg("FREQ").arg("old:0").query::<u64>(&mut conn).unwrap_err();
    assert!(e.to_string().contains("An LFU maxmemory policy is not selected"), "{e}");
    // Enough new keys to evict about as many keys as are old.
    for i in 0..FITTING * 2 / 3 {
        set(&mut conn, &format!("new:{i}"), None).unwrap_or_else(|e| panic!("SET new:{i}: {e}"));
    }
    let (read, old) = (present(&mut conn, "read", half), present(&mut conn, "old", half));
    eprintln!("allkeys-lru: {read} of {half} keys read 1 s ago and {old} of {half} unread for 3 s left");
    assert!(old < half, "nothing was evicted");
    assert!(read >= half * 7 / 10, "only {read} of {half} recently read keys are left ({old} older ones)");
    assert!(
        old <= half * 4 / 10 && old * 2 < read,
        "{old} of {half} keys unread the longest outlived those read since"
    );
}

/// With no limit the refresher sleeps; the first write after `CONFIG SET maxmemory` wakes
/// it, and it reads the memnode's statistics (the keys written before the limit count).
#[test]
fn a_limit_set_at_run_time_wakes_the_refresher() {
    let (_m, node, mut conn) = cache("allkeys-random");
    redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0").query::<()>(&mut conn).unwrap();
    let keys = (LIMIT / 2 / VALUE.len() as u64) as usize;
    for i in 0..keys {
        set(&mut conn, &format!("before:{i}"), None).unwrap();
    }
    redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1gb").query::<()>(&mut conn).unwrap();
    set(&mut conn, "after", None).unwrap();
    let counted = keys as u64 * VALUE.len() as u64;
    // Liveness only: one refresh is due within 100 ms of the write.
    let mut used = 0;
    for _ in 0..200 {
        used = node.status().memnodes[0].used_bytes;
        if used >= counted {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(used >= counted, "the refresher never counted the {keys} keys written before the limit: {used} B");
}

const PASSWORD: &str = "cache secret";

/// A memnode of 32 MiB and a computenode serving the attach and remote front ends on it,
/// with `maxmemory` 1 MiB; a client of each.
fn library_cache(policy: &str, dir: &std::path::Path) -> (TestMemnode, Computenode, [Client; 2]) {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 32 << 20, 16);
    let node = Computenode::start(ComputenodeConfig {
        memnodes: vec![m.endpoint().unwrap().to_string()],
        token: TestMemnode::TOKEN.into(),
        requirepass: Some(PASSWORD.into()),
        redis_addr: None,
        metrics_addr: None,
        remote_addr: Some("127.0.0.1:0".into()),
        attach_socket: Some(dir.join("computenode.sock")),
        ready_sessions: 2,
        prefetch_chunks: 1,
        // Each worker's session holds a chunk of its own (64 KiB): a loaded machine scaled
        // one sequential client's workers to 50, and the heap's footprint with them.
        max_workers: 2,
        maxmemory: Limit::Bytes(LIMIT),
        maxmemory_policy: policy.into(),
        ..ComputenodeConfig::default()
    })
    .unwrap();
    let socket = node.status().attach_socket.unwrap();
    let attached = Client::builder().attach(&socket).connect().unwrap();
    let remote_addr = node.remote_endpoint().unwrap().trim_start_matches("tcp:").to_string();
    let remote = Client::builder().remote(remote_addr).password(PASSWORD).connect().unwrap();
    (m, node, [attached, remote])
}

/// 10x maxmemory written through the attached library (puts, puts with a TTL, multi-puts),
/// then through the remote one: no write fails, the memnode stays near the limit, and the
/// evictions are counted with the Redis front end's.
#[test]
fn library_writes_evict_through_the_attach_and_remote_front_ends() {
    let dir = tempfile::tempdir().unwrap();
    let (m, node, clients) = library_cache("allkeys-random", dir.path());
    let keys = (10 * LIMIT / VALUE.len() as u64) as usize;
    for (name, client) in ["attached", "remote"].into_iter().zip(&clients) {
        let evicted_before = racekv_redis::maxmemory::evicted_keys();
        for i in (0..keys).step_by(4) {
            let key = |j: usize| format!("{name}:{}", i + j).into_bytes();
            client.put(&key(0), &VALUE).unwrap_or_else(|e| panic!("{name}: put {i} of {keys}: {e}"));
            client.put_ex(&key(1), &VALUE, Duration::from_secs(3600)).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (k2, k3) = (key(2), key(3));
            client.multi_put(&[(&k2, &VALUE[..]), (&k3, &VALUE[..])]).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        std::thread::sleep(Duration::from_millis(300)); // a refresh or two
        let used = node.status().memnodes[0].used_bytes;
        let footprint = m.stats().heap.heap_used_bytes;
        eprintln!("{name}: {keys} keys written: estimated live data {used} B, heap footprint {footprint} B");
        assert!(used <= LIMIT + LIMIT / 4, "{name}: estimated live data {used} B, limit {LIMIT} B");
        assert!(footprint <= 2 * LIMIT, "{name}: the memnode's heap holds {footprint} B, limit {LIMIT} B");
        let evicted = racekv_redis::maxmemory::evicted_keys() - evicted_before;
        assert!(evicted >= keys as u64 / 2, "{name}: evicted {evicted} of {keys}");
        // The key written last (the last multi-put's second): no later write could evict
        // it. (`keys - 1` could be an earlier key of that round, fair game for
        // allkeys-random: CI once saw it evicted.)
        let last = format!("{name}:{}", (keys - 1) / 4 * 4 + 3);
        assert_eq!(client.get(last.as_bytes()).unwrap().as_deref(), Some(&VALUE[..]), "{name}: the last key");
    }
}

/// Under noeviction, a library write over the limit fails with its memnode's
/// `OutOfSpace`, carrying Redis' OOM message, on both front ends.
#[test]
fn library_writes_over_the_limit_under_noeviction_are_out_of_space() {
    let dir = tempfile::tempdir().unwrap();
    let (_m, _node, clients) = library_cache("noeviction", dir.path());
    for (name, client) in ["attached", "remote"].into_iter().zip(&clients) {
        let mut written = 0;
        let e = loop {
            match client.put(format!("{name}:{written}").as_bytes(), &VALUE) {
                Ok(()) => written += 1,
                Err(e) => break e,
            }
            assert!(written < 4 * LIMIT as usize / VALUE.len(), "{name}: noeviction never refused a write");
        };
        assert!(
            matches!(&e, ClientError::OutOfSpace { reason, .. } if reason.contains(OVER_LIMIT_REASON)),
            "{name}: {e}"
        );
    }
}

/// `maxmemory` as a share of the region: from the configuration and from `CONFIG SET`,
/// INFO shows it in bytes, and writes of 10x that stay near it.
#[test]
fn maxmemory_as_a_share_of_the_region() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 32 << 20, 16);
    let node = common::redis_only(&[&m], |c| {
        c.ready_sessions = 2;
        c.prefetch_chunks = 1;
        c.maxmemory = Limit::Share(5_000);
        c.maxmemory_policy = "allkeys-random".into();
    });
    let port = node.redis_addr().unwrap().port();
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap().get_connection().unwrap();
    let region = node.status().memnodes[0].region_bytes;
    let maxmemory = |conn: &mut redis::Connection| {
        let info: String = redis::cmd("INFO").arg("memory").query(conn).unwrap();
        let line = info.lines().find_map(|l| l.strip_prefix("maxmemory:")).unwrap_or_else(|| panic!("{info}"));
        line.trim().parse::<u64>().unwrap()
    };
    assert_eq!(maxmemory(&mut conn), region / 2);
    assert_eq!(node.status().memnodes[0].maxmemory_bytes, region / 2);
    redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("3.12%").query::<()>(&mut conn).unwrap();
    let limit = region * 312 / 10_000;
    assert_eq!((maxmemory(&mut conn), node.status().memnodes[0].maxmemory_bytes), (limit, limit));
    let got: Vec<String> = redis::cmd("CONFIG").arg("GET").arg("maxmemory").query(&mut conn).unwrap();
    assert_eq!(Limit::parse(&got[1]).unwrap().bytes_of(region), limit, "CONFIG GET: {got:?}");
    for bad in ["0%", "101%", "1.234%", "half"] {
        let e = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(bad).query::<()>(&mut conn).unwrap_err();
        assert!(e.to_string().contains("maxmemory"), "{bad}: {e}");
    }
    let keys = (10 * limit / VALUE.len() as u64) as usize;
    for i in 0..keys {
        set(&mut conn, &format!("key:{i}"), None).unwrap_or_else(|e| panic!("SET {i} of {keys}: {e}"));
    }
    std::thread::sleep(Duration::from_millis(300)); // a refresh or two
    let used = node.status().memnodes[0].used_bytes;
    assert!(used <= limit + limit / 4, "estimated live data {used} B, limit {limit} B");
}
