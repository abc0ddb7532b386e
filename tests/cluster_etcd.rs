//! `racekv cluster init`, `status` and `manage` against a real etcd and three memnodes
//! registered in it (issue 17, items 1 and 3): the first map from the registered memnodes,
//! a second `init` refused, a stopped memnode shown as mapped but without a lease, and
//! failed over by the checker.
#![cfg(feature = "etcd")]

use std::process::Command;
use std::time::Duration;

use racekv_coord::testing::EtcdServer;
use racekv_memnode::{Memnode, MemnodeConfig};

const CLUSTER: &str = "cli-test";

fn memnode(etcd: &[String]) -> Memnode {
    memnode_on(etcd, None, None)
}

/// A memnode on `data_file` (None: an anonymous region) listening on `address` (None: a
/// free port).
fn memnode_on(etcd: &[String], data_file: Option<std::path::PathBuf>, address: Option<&str>) -> Memnode {
    let cfg = MemnodeConfig {
        region_bytes: 16 << 20,
        listen_tcp: Some(address.unwrap_or("127.0.0.1:0").into()),
        metrics_addr: None,
        etcd_endpoints: etcd.to_vec(),
        cluster: CLUSTER.into(),
        data_file,
        ..MemnodeConfig::default()
    };
    Memnode::start(cfg).expect("memnode starts and registers")
}

fn cluster(etcd: &[String], args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_racekv"))
        .arg("cluster")
        .args(args)
        .args(["--etcd", &etcd.join(","), "--cluster", CLUSTER])
        .output()
        .unwrap()
}

/// `racekv cluster manage` (checking every 50 ms, with `extra` arguments), stopped however
/// the test ends.
struct Manage {
    child: std::process::Child,
    metrics_addr: String,
}

impl Manage {
    fn start(etcd: &[String], extra: &[&str]) -> Self {
        use std::io::{BufRead, BufReader};
        let mut child = Command::new(env!("CARGO_BIN_EXE_racekv"))
            .args(["cluster", "manage", "--etcd", &etcd.join(","), "--cluster", CLUSTER])
            .args(["--metrics-addr", "127.0.0.1:0", "--check-interval-ms", "50"])
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut ready).unwrap();
        let metrics_addr = ready.split_whitespace().find_map(|w| w.strip_prefix("metrics=")).expect(&ready).into();
        Self { child, metrics_addr }
    }

    /// The value of the series `name` (no labels) on its metrics page.
    fn metric(&self, name: &str) -> f64 {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(&self.metrics_addr).unwrap();
        conn.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut body = String::new();
        conn.read_to_string(&mut body).unwrap();
        let line = body.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(' ')).expect(name);
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }
}

impl Drop for Manage {
    fn drop(&mut self) {
        racekv_telemetry::child::stop(&mut self.child, Duration::from_secs(5));
    }
}

/// Every key of `model` on exactly the memnodes of its replica set, with its value there;
/// no move left half done.
fn check_copies(
    etcd: &racekv_coord::etcd::Etcd,
    memnodes: &[Memnode],
    model: &std::collections::BTreeMap<String, String>,
) {
    use racekv_client::Client;
    let (map, _) = etcd.map().unwrap().unwrap();
    assert!(map.joining.is_empty(), "no move left half done: {map:?}");
    let registered = etcd.memnodes().unwrap();
    let mut copies = 0;
    for m in memnodes {
        let endpoint = m.endpoints()[0].to_string();
        let id = registered.iter().find(|r| r.endpoints.contains(&endpoint)).expect("registered").node_id;
        let direct = Client::builder().memnode(endpoint).connect().unwrap();
        for (k, v) in model {
            let p = map.partition_of(racekv_client::ring::key_hash(k.as_bytes()));
            let held = direct.get(k.as_bytes()).unwrap();
            if map.partitions[p].contains(&id) {
                assert_eq!(held, Some(v.clone().into_bytes()), "{k} on its replica {id:#x}");
                copies += 1;
            } else {
                assert_eq!(held, None, "{k}: a stale copy on {id:#x}, which does not hold partition {p}");
            }
        }
    }
    assert_eq!(copies, usize::from(map.replicas) * model.len());
}

#[test]
fn init_writes_the_first_map_and_status_shows_it() {
    let server = EtcdServer::start();
    let etcd = server.endpoint();
    let none = cluster(&etcd, &["status"]);
    assert!(String::from_utf8_lossy(&none.stdout).contains("no map yet"));
    let refused = cluster(&etcd, &["init"]);
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("no memnode is registered"));
    let waited = cluster(&etcd, &["init", "--wait-memnodes", "3", "--wait-s", "1"]);
    assert!(String::from_utf8_lossy(&waited.stderr).contains("fewer than 3 memnodes registered"), "{waited:?}");

    let mut memnodes: Vec<Memnode> = (0..3).map(|_| memnode(&etcd)).collect();
    let init = cluster(&etcd, &["init", "--replicas", "2", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    assert!(String::from_utf8_lossy(&init.stdout).contains("3 memnodes, 12 partitions, 2 replica(s) each"));
    let again = cluster(&etcd, &["init"]);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already has a map"));
    // An init job run again: success, nothing written.
    let job = cluster(&etcd, &["init", "--if-absent", "--wait-memnodes", "3", "--wait-s", "5"]);
    assert!(job.status.success(), "{}", String::from_utf8_lossy(&job.stderr));
    assert!(String::from_utf8_lossy(&job.stdout).contains("a map is there already (epoch 1): nothing written"));

    let status = |etcd: &[String]| -> serde_json::Value {
        let out = cluster(etcd, &["status", "--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let s = status(&etcd);
    assert_eq!((s["epoch"].as_u64(), s["replicas"].as_u64(), s["partitions"].as_u64()), (Some(1), Some(2), Some(12)));
    let rows = s["memnodes"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for row in rows {
        assert_eq!((row["registered"].as_bool(), row["mapped"].as_bool()), (Some(true), Some(true)));
        assert_eq!((row["primary_partitions"].as_u64(), row["replica_partitions"].as_u64()), (Some(4), Some(4)));
    }
    // A memnode stopped: still in the map, no longer registered.
    memnodes.pop().unwrap().shutdown().unwrap();
    let s = status(&etcd);
    let down: Vec<_> = s["memnodes"].as_array().unwrap().iter().filter(|r| r["registered"] == false).collect();
    assert_eq!(down.len(), 1);
    assert_eq!(down[0]["mapped"], true);
    let text = String::from_utf8_lossy(&cluster(&etcd, &["status"]).stdout).to_string();
    assert!(text.contains("map epoch 1, R = 2, 12 partitions") && text.contains("no lease"), "{text}");
}

/// `racekv cluster manage`: a memnode that leaves (its registration gone) is taken out of
/// every replica set by the checker, its partitions go on on their other replica, and the
/// checker's metrics say so.
#[test]
fn manage_fails_over_a_memnode_that_leaves() {
    use std::time::Instant;

    let server = EtcdServer::start();
    let etcd = server.endpoint();
    let mut memnodes: Vec<Memnode> = (0..3).map(|_| memnode(&etcd)).collect();
    let init = cluster(&etcd, &["init", "--replicas", "2", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let manage = Manage::start(&etcd, &[]);
    let metric = |name: &str| manage.metric(name);

    let gone = memnodes.pop().unwrap();
    gone.shutdown().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let s = loop {
        let out = cluster(&etcd, &["status", "--json"]);
        let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        if s["epoch"].as_u64() == Some(2) {
            break s;
        }
        assert!(Instant::now() < deadline, "no failover within 20 s: {s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let rows = s["memnodes"].as_array().unwrap();
    let (down, live): (Vec<_>, Vec<_>) = rows.iter().partition(|r| r["registered"] == false);
    assert_eq!(down.len(), 1);
    assert_eq!((down[0]["mapped"].as_bool(), down[0]["primary_partitions"].as_u64()), (Some(true), Some(0)));
    assert_eq!(down[0]["replica_partitions"].as_u64(), Some(0));
    let primaries: u64 = live.iter().map(|r| r["primary_partitions"].as_u64().unwrap()).sum();
    let backups: u64 = live.iter().map(|r| r["replica_partitions"].as_u64().unwrap()).sum();
    // Every partition has its live replica as primary; only those of the two live memnodes
    // alone (4 of 12) keep a backup.
    assert_eq!((primaries, backups), (12, 4));
    assert_eq!(metric("racekv_cluster_failovers_total"), 1.0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric("racekv_cluster_memnodes_down") != 1.0 {
        assert!(Instant::now() < deadline, "the gauge should count the memnode listed without a lease");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The 8 partitions that had a replica on it run on one copy.
    assert_eq!(metric("racekv_cluster_partitions_under_replicated"), 8.0);
    assert_eq!(metric("racekv_cluster_partitions_unavailable"), 0.0);
    assert!(metric("racekv_cluster_failover_check_seconds_count") >= 1.0);
    // A second memnode leaves: the 4 partitions it alone still held have no live replica.
    memnodes.pop().unwrap().shutdown().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric("racekv_cluster_partitions_unavailable") != 4.0 {
        assert!(Instant::now() < deadline, "the gauge should count the partitions left with no live replica");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `racekv cluster rejoin` (issue 17): a memnode failed over while keys changed comes back
/// on its data file and is made a replica again of what it left, caught up (its stale
/// copies replaced, deleted keys removed): every partition's replicas hold the same keys
/// and values, and every key its last write. Twice, the second time by `racekv cluster
/// manage --heal` on its own.
#[test]
fn rejoin_restores_r_after_a_failover() {
    use std::collections::BTreeMap;

    use racekv_client::Client;
    use racekv_coord::etcd::Etcd;

    let server = EtcdServer::start();
    let etcd_urls = server.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let mut memnodes: Vec<Memnode> =
        (0..3).map(|i| memnode_on(&etcd_urls, Some(dir.path().join(format!("m{i}.region"))), None)).collect();
    let etcd = Etcd::connect(&etcd_urls, CLUSTER, Duration::from_secs(5)).unwrap();
    let endpoint = |m: &Memnode| m.endpoints()[0].to_string();
    let node_of = |m: &Memnode| -> u64 {
        let e = endpoint(m);
        etcd.memnodes().unwrap().into_iter().find(|r| r.endpoints.contains(&e)).expect("registered").node_id
    };
    let init = cluster(&etcd_urls, &["init", "--replicas", "2", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let client = Client::builder().etcd(etcd_urls.clone(), CLUSTER).timeout(Duration::from_secs(10)).connect().unwrap();
    let mut model = BTreeMap::new();
    let write = |client: &Client, model: &mut BTreeMap<String, String>, range: std::ops::Range<u32>, round: u32| {
        for i in range {
            let (k, v) = (format!("k{i}"), format!("v{round}-{i}"));
            let deleted = (i + round).is_multiple_of(5);
            // Writes racing a failover may find the stopped memnode before the new map:
            // done again (each is idempotent) until one is acknowledged.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let done = if deleted {
                    client.delete(k.as_bytes()).map(|_| ())
                } else {
                    client.put(k.as_bytes(), v.as_bytes())
                };
                match done {
                    Ok(()) => break,
                    Err(e) if std::time::Instant::now() < deadline => eprintln!("{k}: {e}; again"),
                    Err(e) => panic!("{k}: {e}"),
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if deleted {
                model.remove(&k);
            } else {
                model.insert(k, v);
            }
        }
    };
    write(&client, &mut model, 0..300, 0);
    let check = |memnodes: &[Memnode], model: &BTreeMap<String, String>| {
        let (map, _) = etcd.map().unwrap().unwrap();
        assert!(map.joining.is_empty() && map.partitions.iter().all(|set| set.len() == 2), "R restored: {map:?}");
        let mut held = BTreeMap::new();
        for m in memnodes {
            let direct = Client::builder().memnode(endpoint(m)).connect().unwrap();
            let keys: BTreeMap<Vec<u8>, Vec<u8>> = model
                .keys()
                .chain(["gone".to_string()].iter())
                .filter_map(|k| direct.get(k.as_bytes()).unwrap().map(|v| (k.clone().into_bytes(), v)))
                .collect();
            held.insert(node_of(m), keys);
        }
        for (k, v) in model {
            let p = map.partition_of(racekv_client::ring::key_hash(k.as_bytes()));
            for id in &map.partitions[p] {
                assert_eq!(held[id].get(k.as_bytes()), Some(&v.clone().into_bytes()), "{k} on {id:#x}");
            }
            // The memnode back is primary again once primaries are spread: the first read
            // of it finds this client's connection from before its restart closed, replaced
            // and read again without an error.
            assert_eq!(client.get(k.as_bytes()).unwrap(), Some(v.clone().into_bytes()));
        }
        let copies: usize = held.values().map(|h| h.len()).sum();
        assert_eq!(copies, 2 * model.len(), "no copy of a deleted key anywhere, each key on two memnodes");
    };

    // Failed over while keys change; back on its data file, at its address; rejoined.
    let c = node_of(&memnodes[2]);
    let address = endpoint(&memnodes[2]).trim_start_matches("tcp:").to_string();
    // Failed over by this test's check, or by the `manage` daemon's checker once it runs
    // (whichever sees the lease gone first): either way the map lists it nowhere.
    let back = |memnodes: &mut Vec<Memnode>| {
        memnodes.pop().unwrap().shutdown().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            racekv_coord::failover::check_once(&etcd).unwrap();
            let (map, _) = etcd.map().unwrap().unwrap();
            if map.partitions.iter().all(|set| !set.contains(&c)) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "not failed over within 10 s: {map:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    back(&mut memnodes);
    write(&client, &mut model, 0..300, 1);
    memnodes.push(memnode_on(&etcd_urls, Some(dir.path().join("m2.region")), Some(&address)));
    assert_eq!(node_of(&memnodes[2]), c, "the same memnode, back on its data file");
    let unknown = cluster(&etcd_urls, &["rejoin", "0x1234"]);
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("not registered"));
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "racekv-dev-token\n").unwrap();
    let out = cluster(&etcd_urls, &["rejoin", &format!("{c:#x}"), "--token-file", token_file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("replica of 8 more partitions") && text.contains("stale keys removed"), "{text}");
    check(&memnodes, &model);

    // Again, healed by the checker: a memnode back is rejoined without anyone asking.
    let manage = Command::new(env!("CARGO_BIN_EXE_racekv"))
        .args(["cluster", "manage", "--etcd", &etcd_urls.join(","), "--cluster", CLUSTER])
        .args(["--metrics-addr", "none", "--heal"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Daemon(std::process::Child);
    impl Drop for Daemon {
        fn drop(&mut self) {
            racekv_telemetry::child::stop(&mut self.0, Duration::from_secs(5));
        }
    }
    let _manage = Daemon(manage);
    back(&mut memnodes);
    write(&client, &mut model, 0..300, 2);
    memnodes.push(memnode_on(&etcd_urls, Some(dir.path().join("m2.region")), Some(&address)));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    // Healed, and its share of primaries given back (it came back a backup everywhere).
    let spread = |map: &racekv_coord::ClusterMap| map.partitions.iter().filter(|set| set[0] == c).count() == 4;
    loop {
        let (map, _) = etcd.map().unwrap().unwrap();
        if map.partitions.iter().all(|set| set.len() == 2) && spread(&map) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not healed within 30 s: {map:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    check(&memnodes, &model);
}

#[test]
fn memnodes_leave_and_r_changes_while_clients_write() {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Mutex;

    use racekv_client::Client;
    use racekv_coord::etcd::Etcd;

    let server = EtcdServer::start();
    let etcd_urls = server.endpoint();
    let mut memnodes: Vec<Memnode> = (0..3).map(|_| memnode(&etcd_urls)).collect();
    let etcd = Etcd::connect(&etcd_urls, CLUSTER, Duration::from_secs(5)).unwrap();
    let endpoint = |m: &Memnode| m.endpoints()[0].to_string();
    let node_of = |m: &Memnode| -> u64 {
        let e = endpoint(m);
        etcd.memnodes().unwrap().into_iter().find(|r| r.endpoints.contains(&e)).expect("registered").node_id
    };
    let init = cluster(&etcd_urls, &["init", "--replicas", "1", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let client = Client::builder().etcd(etcd_urls.clone(), CLUSTER).timeout(Duration::from_secs(10)).connect().unwrap();
    // Two writers on disjoint keys, each remembering what was acknowledged last; a reader.
    let model: Vec<Mutex<BTreeMap<String, String>>> = (0..2).map(|_| Mutex::new(BTreeMap::new())).collect();
    let (stop, errors, rounds) = (AtomicBool::new(false), AtomicU64::new(0), AtomicU64::new(0));
    let increments = AtomicU64::new(0);
    let run = |cmd: &[&str]| {
        let out = cluster(&etcd_urls, cmd);
        assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let check = |memnodes: &[Memnode], model: &BTreeMap<String, String>| check_copies(&etcd, memnodes, model);
    std::thread::scope(|scope| {
        for (w, model) in model.iter().enumerate() {
            let (client, stop, errors, rounds) = (&client, &stop, &errors, &rounds);
            scope.spawn(move || {
                let mut round = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    for i in (w as u32..200).step_by(2) {
                        let (k, v) = (format!("k{i}"), format!("v{round}-{i}"));
                        match client.put(k.as_bytes(), v.as_bytes()) {
                            Ok(()) => {
                                model.lock().unwrap().insert(k, v);
                            }
                            Err(e) => {
                                eprintln!("{k}: {e}");
                                errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        // Counters incremented by compare-and-swap: a move that let two writers both
        // succeed from one value (the old primary's and the new one's) would lose one.
        let (client_ref, stop_ref, errors_ref, increments_ref) = (&client, &stop, &errors, &increments);
        scope.spawn(move || {
            let mut i = 0u32;
            while !stop_ref.load(Ordering::Relaxed) {
                i += 1;
                let key = format!("counter{}", i % 4);
                let done = client_ref.get(key.as_bytes()).and_then(|old| {
                    let n: u64 = old.as_deref().map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
                    client_ref.compare_and_swap(key.as_bytes(), old.as_deref(), Some((n + 1).to_string().as_bytes()))
                });
                match done {
                    Ok(true) => {
                        increments_ref.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(false) => {}
                    Err(e) => {
                        eprintln!("{key}: {e}");
                        errors_ref.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
        let wait_rounds = |n: u64| {
            let target = rounds.load(Ordering::Relaxed) + n;
            while rounds.load(Ordering::Relaxed) < target {
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        wait_rounds(2);
        // A memnode leaves: its partitions go to the two others while the writers write.
        let leaving = node_of(&memnodes[2]);
        let out = run(&["remove-memnode", &format!("{leaving:#x}")]);
        assert!(out.contains("removed from the map (4 partitions moved"), "{out}");
        let (map, _) = etcd.map().unwrap().unwrap();
        assert!(map.memnode(leaving).is_none() && map.partitions.iter().all(|set| !set.contains(&leaving)));
        memnodes.pop().unwrap().shutdown().unwrap();
        wait_rounds(2);
        // R raised to 2 and lowered again, still under writes.
        let out = run(&["set-replicas", "2"]);
        assert!(out.contains("R = 2 (was 1)"), "{out}");
        wait_rounds(2);
        let out = run(&["set-replicas", "1"]);
        assert!(out.contains("R = 1 (was 2)") && out.contains("stale copies removed"), "{out}");
        wait_rounds(2);
        // A new memnode joins: the clients (started before it existed) connect to it as
        // they install the map that lists it, and a third of the partitions move to it.
        memnodes.push(memnode(&etcd_urls));
        let added = node_of(&memnodes[2]);
        let out = run(&["add-memnode", &format!("{added:#x}")]);
        assert!(out.contains("in the map (4 partitions moved"), "{out}");
        let (map, _) = etcd.map().unwrap().unwrap();
        assert_eq!(map.partitions.iter().filter(|set| set[0] == added).count(), 4, "{map:?}");
        wait_rounds(2);
        stop.store(true, Ordering::Relaxed);
    });
    assert_eq!(errors.load(Ordering::Relaxed), 0, "writes failed during the moves");
    let all: BTreeMap<String, String> = model.iter().flat_map(|m| m.lock().unwrap().clone()).collect();
    assert_eq!(all.len(), 200);
    let counted: u64 = (0..4)
        .filter_map(|i| client.get(format!("counter{i}").as_bytes()).unwrap())
        .map(|v| String::from_utf8(v).unwrap().parse::<u64>().unwrap())
        .sum();
    assert!(increments.load(Ordering::Relaxed) > 0);
    assert_eq!(counted, increments.load(Ordering::Relaxed), "every acknowledged increment counted once");
    check(&memnodes, &all);
    assert_eq!(client.len().unwrap(), 204, "DBSIZE: 200 keys and 4 counters, the memnode removed stopped");
    // A walk passes the removed (stopped) memnode over and returns each key once.
    let (mut cursor, mut walked) = (0, Vec::new());
    loop {
        let (next, page) = client.scan(cursor, 50).unwrap();
        walked.extend(page);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    walked.sort();
    assert_eq!(walked.len(), 204, "each key once");
    walked.dedup();
    assert_eq!(walked.len(), 204);
    for (k, v) in &all {
        assert_eq!(client.get(k.as_bytes()).unwrap(), Some(v.clone().into_bytes()), "{k}");
    }
    // Back to R = 2, then spread the primaries (the copies' memnode is a backup of all).
    run(&["set-replicas", "2"]);
    check(&memnodes, &all);
    assert_eq!(client.len().unwrap(), 204, "DBSIZE at R = 2");
    let out = run(&["balance"]);
    assert!(out.contains("already spread") || out.contains("primaries spread"), "{out}");
}

/// `add-memnode` while another process keeps moving primaries (as the healer's `balance`
/// may, or failovers): a move whose primary changed while it was copied is copied again
/// from the new one, or called off, never left joining for good (the healer once left 4
/// partitions joining in the operator's guide). A writer writes throughout; after, every
/// key is on exactly its replicas with its last acknowledged value.
#[test]
fn a_memnode_is_added_while_primaries_keep_moving() {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use racekv_client::Client;
    use racekv_coord::etcd::Etcd;

    let server = EtcdServer::start();
    let etcd_urls = server.endpoint();
    let mut memnodes: Vec<Memnode> = (0..2).map(|_| memnode(&etcd_urls)).collect();
    let etcd = Etcd::connect(&etcd_urls, CLUSTER, Duration::from_secs(5)).unwrap();
    let init = cluster(&etcd_urls, &["init", "--replicas", "2", "--partitions-per-memnode", "6"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let client = Client::builder().etcd(etcd_urls.clone(), CLUSTER).timeout(Duration::from_secs(10)).connect().unwrap();
    let (writing, shuffling, errors, swaps) =
        (AtomicBool::new(true), AtomicBool::new(true), AtomicU64::new(0), AtomicU64::new(0));
    let mut model = BTreeMap::new();
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let mut round = 0u32;
            while writing.load(Ordering::Relaxed) {
                round += 1;
                for i in 0..100 {
                    let (k, v) = (format!("k{i}"), format!("v{round}-{i}"));
                    match client.put(k.as_bytes(), v.as_bytes()) {
                        Ok(()) => drop(model.insert(k, v)),
                        Err(e) => {
                            eprintln!("{k}: {e}");
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        });
        // While a move is under way, each set's primary keeps stepping down for its next
        // replica (epoch words of the memnodes involved raised first, as every map change
        // that moves primaries does).
        scope.spawn(|| {
            while shuffling.load(Ordering::Relaxed) {
                let (map, revision) = etcd.map().unwrap().unwrap();
                if map.joining.is_empty() {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                let mut next = map.clone();
                next.partitions.iter_mut().for_each(|set| set.rotate_left(1));
                next.epoch += 1;
                for node in racekv_coord::membership::fenced(&map, &next) {
                    // The client may not follow the map naming the added memnode yet: it
                    // connects to it within moments (giving up midway would leave memnodes
                    // serving an epoch no map in etcd has, and every client waiting on it).
                    let deadline = std::time::Instant::now() + Duration::from_secs(10);
                    while let Err(e) = client.raise_served_epoch(node, next.epoch) {
                        assert!(std::time::Instant::now() < deadline, "raising {node:#x}'s epoch: {e}");
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                if etcd.put_map(&next, Some(revision)).unwrap().is_some() {
                    swaps.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        // Stops both threads when an assertion below fails too (the scope joins them).
        struct Stop<'a>(&'a [&'a AtomicBool]);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.iter().for_each(|flag| flag.store(false, Ordering::Relaxed));
            }
        }
        let running = [&shuffling, &writing];
        let _stop = Stop(&running);
        std::thread::sleep(Duration::from_millis(300));
        memnodes.push(memnode(&etcd_urls));
        let endpoint = memnodes[2].endpoints()[0].to_string();
        let added = etcd.memnodes().unwrap().into_iter().find(|m| m.endpoints.contains(&endpoint));
        let added = added.expect("registered").node_id;
        let out = cluster(&etcd_urls, &["add-memnode", &format!("{added:#x}")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        shuffling.store(false, Ordering::Relaxed);
        let (map, _) = etcd.map().unwrap().unwrap();
        assert!(map.joining.is_empty(), "no move left joining: {map:?}\n{stderr}");
        assert!(map.partitions.iter().any(|set| set.contains(&added)), "some partition moved: {map:?}");
        std::thread::sleep(Duration::from_millis(300));
        writing.store(false, Ordering::Relaxed);
        writer.join().unwrap();
    });
    eprintln!("primaries moved {} times during the moves", swaps.load(Ordering::Relaxed));
    assert!(swaps.load(Ordering::Relaxed) > 0, "primaries moved during the moves");
    assert_eq!(errors.load(Ordering::Relaxed), 0, "writes failed during the moves");
    assert_eq!(model.len(), 100);
    check_copies(&etcd, &memnodes, &model);
}

/// A mover that dies midway (`add-memnode`, `remove-memnode`) leaves its moves under way:
/// the takers joining, every write of those partitions going to them too. `manage --heal`
/// leaves them be while a mover's claim stands, and calls them off once it is gone: the
/// replica sets as before, and the takers' copies removed (every key on exactly its
/// replicas, with its value).
#[test]
fn the_healer_calls_off_the_moves_of_a_mover_that_is_gone() {
    use std::collections::BTreeMap;
    use std::time::Instant;

    use racekv_client::Client;
    use racekv_coord::etcd::Etcd;
    use racekv_coord::membership::{start_moves, Move};

    let server = EtcdServer::start();
    let etcd_urls = server.endpoint();
    let memnodes: Vec<Memnode> = (0..3).map(|_| memnode(&etcd_urls)).collect();
    let init = cluster(&etcd_urls, &["init", "--replicas", "2", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let etcd = Etcd::connect(&etcd_urls, CLUSTER, Duration::from_secs(5)).unwrap();
    let (map, revision) = etcd.map().unwrap().unwrap();
    // A dead mover's work: two partitions each joined by the memnode outside their set.
    let claim = etcd.claim_mover("this test", Duration::from_secs(1)).unwrap();
    let moves: Vec<Move> = [0usize, 5]
        .iter()
        .map(|&p| {
            let set = &map.partitions[p];
            let to = map.memnodes.iter().map(|m| m.node_id).find(|id| !set.contains(id)).unwrap();
            Move { partition: p, from: set[1], to }
        })
        .collect();
    let started = start_moves(&map, &moves).unwrap();
    etcd.put_map(&started, Some(revision)).unwrap().expect("no other writer");
    // Writes meanwhile go to the takers too.
    let client = Client::builder().etcd(etcd_urls.clone(), CLUSTER).timeout(Duration::from_secs(10)).connect().unwrap();
    let mut model = BTreeMap::new();
    for i in 0..300 {
        let (k, v) = (format!("k{i}"), format!("v{i}"));
        client.put(k.as_bytes(), v.as_bytes()).unwrap();
        model.insert(k, v);
    }

    let manage = Manage::start(&etcd_urls, &["--heal"]);
    let called_off = || manage.metric("racekv_cluster_moves_called_off_total");
    // While the claim stands (its keep-alive running), the moves stay: several healer rounds.
    std::thread::sleep(Duration::from_secs(3));
    let (now, _) = etcd.map().unwrap().unwrap();
    assert_eq!(now.joining, started.joining, "moves called off while their mover's claim stood");
    assert_eq!(called_off(), 0.0);
    // The mover is gone (its claim revoked, as a lapsed lease would be).
    drop(claim);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (now, _) = etcd.map().unwrap().unwrap();
        if now.joining.is_empty() && called_off() == 2.0 {
            assert_eq!(now.partitions, map.partitions, "calling a move off keeps the replica sets");
            break;
        }
        assert!(Instant::now() < deadline, "the moves were not called off: {now:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The count goes up once the takers' copies are removed too.
    check_copies(&etcd, &memnodes, &model);
}

/// A TCP relay to `upstream` that the test can cut: every connection through it closed and
/// new ones refused, as a network partition would (the side using it loses etcd).
struct Cuttable {
    addr: std::net::SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Cuttable {
    fn to(upstream: String) -> Self {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&cut);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(down) = conn else { continue };
                if flag.load(Ordering::Relaxed) {
                    continue; // refused: dropped at once
                }
                let Ok(up) = std::net::TcpStream::connect(&upstream) else { continue };
                for (from, to) in [(down.try_clone().unwrap(), up.try_clone().unwrap()), (up, down)] {
                    let flag = std::sync::Arc::clone(&flag);
                    std::thread::spawn(move || relay(from, to, &flag));
                }
            }
        });
        Self { addr, cut }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// New connections go through again.
    fn restore(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Copies `from` to `to` until either closes or `cut` is set (then both are shut).
fn relay(mut from: std::net::TcpStream, mut to: std::net::TcpStream, cut: &std::sync::atomic::AtomicBool) {
    use std::io::{ErrorKind, Read, Write};
    from.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    let mut buf = [0u8; 16 << 10];
    while !cut.load(std::sync::atomic::Ordering::Relaxed) {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) if to.write_all(&buf[..n]).is_ok() => {}
            Ok(_) => break,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// The stale reader the fence closes (ARCHITECTURE, "Failover"): a memnode and a client cut
/// off from etcd together, the memnode failed over, another client writing by the new map.
/// One-sided reads never ask the memnode's CPU, so only its fence (set when its lease's
/// local deadline passed) stops the cut-off client, which still routes by the old map,
/// from reading the old values there: it must get the new values or an error, never the old.
#[test]
fn a_client_cut_off_with_its_failed_over_primary_reads_nothing_stale() {
    use racekv_client::Client;
    use racekv_coord::etcd::Etcd;

    let server = EtcdServer::start();
    let etcd_urls = server.endpoint();
    let link = Cuttable::to(etcd_urls[0].trim_start_matches("http://").to_string());
    let cut_side = vec![link.url()];
    let start = |etcd: &[String]| {
        let cfg = MemnodeConfig {
            region_bytes: 16 << 20,
            listen_tcp: Some("127.0.0.1:0".into()),
            metrics_addr: None,
            etcd_endpoints: etcd.to_vec(),
            cluster: CLUSTER.into(),
            etcd_lease_ms: 1_000,
            ..MemnodeConfig::default()
        };
        Memnode::start(cfg).expect("memnode starts and registers")
    };
    let memnodes = [start(&cut_side), start(&etcd_urls)];
    let init = cluster(&etcd_urls, &["init", "--replicas", "2", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let _manage = Manage::start(&etcd_urls, &[]);
    let etcd = Etcd::connect(&etcd_urls, CLUSTER, Duration::from_secs(5)).unwrap();
    let cut_endpoint = memnodes[0].endpoints()[0].to_string();
    let cut_id =
        etcd.memnodes().unwrap().into_iter().find(|r| r.endpoints.contains(&cut_endpoint)).expect("registered").node_id;
    let (before, _) = etcd.map().unwrap().unwrap();
    let keys: Vec<String> = (0..1_000)
        .map(|i| format!("k{i}"))
        .filter(|k| before.replicas_of(before.partition_of(racekv_client::ring::key_hash(k.as_bytes())))[0] == cut_id)
        .take(5)
        .collect();
    assert_eq!(keys.len(), 5, "keys the cut memnode is primary of");

    let timeout = Duration::from_secs(2);
    // No map lease: the fence alone must stop it (the lease is tested below).
    let cut_client =
        Client::builder().etcd(cut_side, CLUSTER).timeout(timeout).map_lease(Duration::ZERO).connect().unwrap();
    let client = Client::builder().etcd(etcd_urls.clone(), CLUSTER).timeout(Duration::from_secs(10)).connect().unwrap();
    for k in &keys {
        client.put(k.as_bytes(), b"old").unwrap();
        assert_eq!(cut_client.get(k.as_bytes()).unwrap().as_deref(), Some(&b"old"[..]));
    }

    link.cut();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (map, _) = etcd.map().unwrap().unwrap();
        if map.write_sets().iter().all(|set| !set.contains(&cut_id)) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the cut-off memnode was not failed over: {map:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    for k in &keys {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while let Err(e) = client.put(k.as_bytes(), b"new") {
            assert!(std::time::Instant::now() < deadline, "{k}: {e}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let mut refused = 0;
    for k in &keys {
        match cut_client.get(k.as_bytes()) {
            Ok(v) => assert_eq!(v.as_deref(), Some(&b"new"[..]), "{k}: a stale read by the old map"),
            Err(e) => {
                assert!(e.to_string().contains("is fenced"), "{k}: {e}");
                refused += 1;
            }
        }
    }
    // Cut off, it cannot learn the new map: every read is refused.
    assert_eq!(refused, keys.len());
}

/// A client cut off from etcd stops serving once its map lease lapses (it could miss a
/// failover: a memnode stalled on shm or verbs answers one-sided operations and cannot
/// fence itself), though its memnode answers all along; it serves again once etcd answers.
#[test]
fn a_client_cut_off_from_etcd_stops_serving_when_its_map_lease_lapses() {
    use racekv_client::{Client, ClientError};

    let server = EtcdServer::start();
    let etcd_urls = server.endpoint();
    let link = Cuttable::to(etcd_urls[0].trim_start_matches("http://").to_string());
    let _memnode = memnode(&etcd_urls);
    let init = cluster(&etcd_urls, &["init"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let lease = Duration::from_millis(500);
    let client = Client::builder()
        .etcd([link.url()], CLUSTER)
        .map_lease(lease)
        .timeout(Duration::from_secs(2))
        .connect()
        .unwrap();
    client.put(b"k", b"v").unwrap();
    std::thread::sleep(2 * lease);
    assert_eq!(client.get(b"k").unwrap().as_deref(), Some(&b"v"[..]), "renewed while etcd answers");

    link.cut();
    std::thread::sleep(lease + Duration::from_millis(300));
    let refused = client.get(b"k").unwrap_err();
    assert!(matches!(refused, ClientError::MapUnconfirmed { .. }) && refused.is_transient(), "{refused}");
    assert!(client.put(b"k", b"w").is_err(), "writes too");

    link.restore();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match client.get(b"k") {
            Ok(v) => {
                assert_eq!(v.as_deref(), Some(&b"v"[..]), "the refused write was not applied");
                break;
            }
            Err(e) => assert!(std::time::Instant::now() < deadline, "etcd is back, the client still refuses: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A write by the R = 1 map landing just after `set-replicas 2` wrote its map (from a
/// client cut off from etcd, still within its map lease) is a plain upsert on the primary:
/// the copy to the new replica must start after it could land, or the replicas differ and
/// the value is lost at the primary's failover.
#[test]
fn a_plain_write_landing_as_r_rises_reaches_the_new_replica() {
    use racekv_client::Client;
    use racekv_coord::etcd::Etcd;

    let server = EtcdServer::start();
    let etcd_urls = server.endpoint();
    let link = Cuttable::to(etcd_urls[0].trim_start_matches("http://").to_string());
    let memnodes = [memnode(&etcd_urls), memnode(&etcd_urls)];
    let init = cluster(&etcd_urls, &["init", "--replicas", "1", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let etcd = Etcd::connect(&etcd_urls, CLUSTER, Duration::from_secs(5)).unwrap();
    let cut = Client::builder()
        .etcd([link.url()], CLUSTER)
        .map_lease(Duration::from_secs(3))
        .timeout(Duration::from_secs(2))
        .connect()
        .unwrap();
    cut.put(b"late", b"before").unwrap();

    link.cut();
    let cut_at = std::time::Instant::now();
    let urls = etcd_urls.clone();
    let raise = std::thread::spawn(move || cluster(&urls, &["set-replicas", "2"]));
    while etcd.map().unwrap().unwrap().0.replicas != 2 {
        std::thread::sleep(Duration::from_millis(10));
    }
    // After the copy would have run, were it not held back; still by the R = 1 map.
    std::thread::sleep(Duration::from_secs(1));
    // Its lease (3 s from its last read of etcd, at most 0.75 s before the cut) holds.
    assert!(cut_at.elapsed() < Duration::from_millis(2_200), "the write goes within the lease");
    let wrote = cut.put(b"late", b"after");
    let out = raise.join().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let values: Vec<Option<Vec<u8>>> = memnodes
        .iter()
        .map(|m| Client::builder().memnode(m.endpoints()[0].to_string()).connect().unwrap().get(b"late").unwrap())
        .collect();
    assert_eq!(values[0], values[1], "both replicas hold the same value (the write: {wrote:?})");
    assert_eq!(values[0].as_deref(), Some(&b"after"[..]), "the write landed on the primary");
}

/// `racekv cluster recover-lost`: two of three memnodes lost at R = 2 leave 4 of 12
/// partitions with no replica. Without --accept-loss it refuses, saying how many; with it
/// the live memnode takes them over empty: every key can be written and read again, keys
/// of the other partitions kept, those of the lost ones gone.
#[test]
fn recover_lost_serves_partitions_whose_every_replica_is_gone_from_empty() {
    use racekv_client::Client;
    use racekv_coord::etcd::Etcd;

    let server = EtcdServer::start();
    let etcd_urls = server.endpoint();
    let mut memnodes: Vec<Memnode> = (0..3).map(|_| memnode(&etcd_urls)).collect();
    let init = cluster(&etcd_urls, &["init", "--replicas", "2", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let etcd = Etcd::connect(&etcd_urls, CLUSTER, Duration::from_secs(5)).unwrap();
    let client = Client::builder().etcd(etcd_urls.clone(), CLUSTER).timeout(Duration::from_secs(5)).connect().unwrap();
    let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
    for k in &keys {
        client.put(k.as_bytes(), b"before").unwrap();
    }
    let (before, _) = etcd.map().unwrap().unwrap();

    let nothing = cluster(&etcd_urls, &["recover-lost"]);
    assert!(String::from_utf8_lossy(&nothing.stdout).contains("nothing to recover"), "{nothing:?}");
    // The checker fails over what it can (partitions with the survivor): the rest wait.
    let manage = Manage::start(&etcd_urls, &[]);
    memnodes.pop().unwrap().shutdown().unwrap();
    memnodes.pop().unwrap().shutdown().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while manage.metric("racekv_cluster_partitions_unavailable") != 4.0 {
        assert!(std::time::Instant::now() < deadline, "4 of 12 partitions had both replicas on the two gone");
        std::thread::sleep(Duration::from_millis(20));
    }
    let survivor = {
        let e = memnodes[0].endpoints()[0].to_string();
        etcd.memnodes().unwrap().into_iter().find(|r| r.endpoints.contains(&e)).expect("registered").node_id
    };
    // An old copy on the survivor of a key of a partition it does not hold (as a memnode
    // failed over from it and not yet rejoined keeps): gone with the partition's keys.
    let stale = keys
        .iter()
        .find(|k| {
            !before.partitions[before.partition_of(racekv_client::ring::key_hash(k.as_bytes()))].contains(&survivor)
        })
        .expect("a key of a lost partition");
    let direct = Client::builder().memnode(memnodes[0].endpoints()[0].to_string()).connect().unwrap();
    direct.put(stale.as_bytes(), b"stale").unwrap();
    let refused = cluster(&etcd_urls, &["recover-lost"]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("4 partitions have no live replica") && said.contains("--accept-loss"), "{said}");

    let out = cluster(&etcd_urls, &["recover-lost", "--accept-loss"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("4 partitions given to live memnodes"), "{out:?}");
    let (after, _) = etcd.map().unwrap().unwrap();
    assert!(after.partitions.iter().all(|set| set == &[survivor]), "{after:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while manage.metric("racekv_cluster_partitions_unavailable") != 0.0 {
        assert!(std::time::Instant::now() < deadline, "the checker still counts partitions with no live replica");
        std::thread::sleep(Duration::from_millis(20));
    }

    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    for k in &keys {
        let p = before.partition_of(racekv_client::ring::key_hash(k.as_bytes()));
        let kept = before.partitions[p].contains(&survivor);
        loop {
            match client.get(k.as_bytes()) {
                Ok(v) => {
                    assert_eq!(v.is_some(), kept, "{k} (partition {p}): kept only where the survivor held it");
                    break;
                }
                Err(e) => assert!(std::time::Instant::now() < deadline, "{k}: {e}"),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        client.put(k.as_bytes(), b"after").unwrap();
        assert_eq!(client.get(k.as_bytes()).unwrap().as_deref(), Some(&b"after"[..]));
    }
}
