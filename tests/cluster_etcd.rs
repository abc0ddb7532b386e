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
    use std::io::{BufRead, BufReader, Read, Write};
    use std::time::Instant;

    let server = EtcdServer::start();
    let etcd = server.endpoint();
    let mut memnodes: Vec<Memnode> = (0..3).map(|_| memnode(&etcd)).collect();
    let init = cluster(&etcd, &["init", "--replicas", "2", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    // Stopped however the test ends.
    struct Daemon(std::process::Child);
    impl Drop for Daemon {
        fn drop(&mut self) {
            racekv_telemetry::child::stop(&mut self.0, Duration::from_secs(5));
        }
    }
    let mut manage = Command::new(env!("CARGO_BIN_EXE_racekv"))
        .args(["cluster", "manage", "--etcd", &etcd.join(","), "--cluster", CLUSTER])
        .args(["--metrics-addr", "127.0.0.1:0", "--check-interval-ms", "50"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map(Daemon)
        .unwrap();
    let mut ready = String::new();
    BufReader::new(manage.0.stdout.take().unwrap()).read_line(&mut ready).unwrap();
    let metrics_addr = ready.split_whitespace().find_map(|w| w.strip_prefix("metrics=")).expect(&ready).to_string();
    let metric = |name: &str| -> f64 {
        let mut conn = std::net::TcpStream::connect(&metrics_addr).unwrap();
        conn.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut body = String::new();
        conn.read_to_string(&mut body).unwrap();
        let line = body.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(' ')).expect(name);
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };

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
    assert!(metric("racekv_cluster_failover_check_seconds_count") >= 1.0);
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
            assert_eq!(client.get(k.as_bytes()).unwrap(), Some(v.clone().into_bytes()));
        }
        let copies: usize = held.values().map(|h| h.len()).sum();
        assert_eq!(copies, 2 * model.len(), "no copy of a deleted key anywhere, each key on two memnodes");
    };

    // Failed over while keys change; back on its data file, at its address; rejoined.
    let c = node_of(&memnodes[2]);
    let address = endpoint(&memnodes[2]).trim_start_matches("tcp:").to_string();
    let back = |memnodes: &mut Vec<Memnode>| {
        memnodes.pop().unwrap().shutdown().unwrap();
        assert!(racekv_coord::failover::check_once(&etcd).unwrap().is_some(), "failed over");
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
    while !etcd.map().unwrap().unwrap().0.partitions.iter().all(|set| set.len() == 2) {
        assert!(std::time::Instant::now() < deadline, "not healed within 30 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    check(&memnodes, &model);
}
