//! A memnode process registering in a real etcd (issue 17, item 1): listed once it serves,
//! gone at once after SIGTERM, gone within its lease after SIGKILL; a start whose etcd
//! cannot be reached fails, bounded, with the reason; its region's map epoch word follows the
//! cluster's map; it registers the endpoints it is told to advertise.
#![cfg(feature = "etcd")]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use racekv_coord::etcd::Etcd;
use racekv_coord::testing::{free_port, EtcdServer};

const CLUSTER: &str = "memnode-test";

/// Starts a memnode registering in `etcd`; returns it once it printed READY, with its tcp
/// endpoint.
fn memnode(etcd: &[String], data: &std::path::Path) -> (Child, String) {
    memnode_with(etcd, data, &[])
}

/// [`memnode`] with more flags.
fn memnode_with(etcd: &[String], data: &std::path::Path, flags: &[&str]) -> (Child, String) {
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_racekv-memnode"))
        .args(["--region-bytes", "16MiB", "--metrics-addr", "none", "--cluster", CLUSTER])
        .args(flags)
        .args(["--listen-tcp", &format!("127.0.0.1:{port}"), "--etcd", &etcd.join(",")])
        .arg("--data-file")
        .arg(data)
        .env("RACEKV_MEMNODE_ETCD_LEASE_MS", "1000")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) if line.starts_with("READY ") => break,
            Some(Ok(_)) => {}
            other => panic!("the memnode exited before READY: {other:?}, {:?}", child.wait()),
        }
    }
    (child, format!("tcp:127.0.0.1:{port}"))
}

fn signal(child: &Child, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
}

#[test]
fn a_memnode_is_listed_while_it_serves() {
    let server = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap();
    let (mut child, endpoint) = memnode(&server.endpoint(), &dir.path().join("a.region"));
    let listed = etcd.memnodes().unwrap();
    assert_eq!(listed.len(), 1, "registered before READY");
    assert_eq!((listed[0].endpoints.clone(), listed[0].region_bytes), (vec![endpoint], 16 << 20));
    let node_id = listed[0].node_id;

    // A clean stop leaves the list before the process is gone.
    signal(&child, nix::sys::signal::Signal::SIGTERM);
    assert!(child.wait().unwrap().success());
    assert!(etcd.memnodes().unwrap().is_empty());

    // The same data file: the same node id. A crash leaves the list within the lease.
    let (mut child, _) = memnode(&server.endpoint(), &dir.path().join("a.region"));
    assert_eq!(etcd.memnodes().unwrap()[0].node_id, node_id, "the node id is the data file's");
    signal(&child, nix::sys::signal::Signal::SIGKILL);
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !etcd.memnodes().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "a killed memnode stayed listed past its lease");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_start_without_its_etcd_fails_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_racekv-memnode"))
        .args(["--region-bytes", "16MiB", "--metrics-addr", "none", "--listen-tcp", "127.0.0.1:0"])
        .args(["--etcd", &format!("http://127.0.0.1:{}", free_port())])
        .arg("--data-file")
        .arg(dir.path().join("b.region"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("etcd"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30), "bounded");
}

/// The map epoch word of the memnode at `endpoint` (what fenced clients read).
fn map_epoch(endpoint: &str) -> u64 {
    let options = racekv_transport::ConnectOptions::new(racekv_memnode::config::DEV_TOKEN, Duration::from_secs(5));
    let conn = racekv_transport::connect(&endpoint.parse().unwrap(), &options).unwrap();
    racekv_hashing::format::read_map_epoch(&*conn).unwrap()
}

#[test]
fn the_map_epoch_word_follows_the_clusters_map() {
    let server = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("a.region");
    let etcd = Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap();
    let someone =
        racekv_coord::MemnodeInfo { node_id: 7, endpoints: vec!["tcp:127.0.0.1:1".into()], region_bytes: 1 << 20 };
    let mut map = racekv_coord::ClusterMap::initial(vec![someone], 1, 1).unwrap();
    map.epoch = 3;
    let revision = etcd.put_map(&map, None).unwrap().unwrap();

    // Set from etcd before it serves, raised as maps are written.
    let (mut child, endpoint) = memnode(&server.endpoint(), &data);
    assert_eq!(map_epoch(&endpoint), 3);
    map.epoch = 9;
    etcd.put_map(&map, Some(revision)).unwrap().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while map_epoch(&endpoint) != 9 {
        assert!(Instant::now() < deadline, "the word never reached epoch 9");
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(&child, nix::sys::signal::Signal::SIGTERM);
    assert!(child.wait().unwrap().success());

    // The same data file in a cluster made anew (no map yet): the old cluster's epoch must
    // not make this one's clients wait for maps that will never come. It registers the
    // endpoint it is told to advertise, not the one it listens on.
    let fresh = EtcdServer::start();
    let (mut child, endpoint) = memnode_with(&fresh.endpoint(), &data, &["--advertise", "tcp:10.1.2.3:7400"]);
    assert_eq!(map_epoch(&endpoint), 0);
    let listed = Etcd::connect(&fresh.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap().memnodes().unwrap();
    assert_eq!(listed[0].endpoints, ["tcp:10.1.2.3:7400"]);
    signal(&child, nix::sys::signal::Signal::SIGTERM);
    assert!(child.wait().unwrap().success());
}

/// The map epoch word of the memnode at `endpoint`, fence bit and all.
fn map_word(endpoint: &str) -> racekv_hashing::format::MapWord {
    let options = racekv_transport::ConnectOptions::new(racekv_memnode::config::DEV_TOKEN, Duration::from_secs(5));
    let conn = racekv_transport::connect(&endpoint.parse().unwrap(), &options).unwrap();
    racekv_hashing::format::MapWord::decode(racekv_hashing::format::read_map_word(&*conn).unwrap())
}

/// Waits up to 20 s for `what` of the memnode's word.
fn wait_word(endpoint: &str, what: &str, want: impl Fn(racekv_hashing::format::MapWord) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let word = map_word(endpoint);
        if want(word) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: the word stayed {word:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A memnode that cannot renew its lease fences itself before etcd could expire it (no
/// failover can then leave its clients reading stale values), and once registered again
/// clears the fence under a new epoch of the same map, which it writes itself (nobody else
/// would: no failover took it).
#[test]
fn a_memnode_cut_off_from_etcd_fences_itself_until_registered_again() {
    use racekv_hashing::format::MapWord;
    let mut server = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap();
    let (mut child, endpoint) = memnode(&server.endpoint(), &dir.path().join("a.region"));
    let info = etcd.memnodes().unwrap().remove(0);
    let mut map = racekv_coord::ClusterMap::initial(vec![info], 1, 1).unwrap();
    map.epoch = 4;
    etcd.put_map(&map, None).unwrap().unwrap();
    wait_word(&endpoint, "raised to the map's", |w| w == MapWord { epoch: 4, fenced: false });

    // etcd down past the 1 s lease: fenced within it (0.9 s after the last renewal).
    server.kill();
    let killed = Instant::now();
    wait_word(&endpoint, "fenced", |w| w == MapWord { epoch: 4, fenced: true });
    // Within the lease (0.9 s after the last renewal, which came at most 1/3 s before the
    // kill), give or take a loaded machine's scheduling.
    assert!(killed.elapsed() < Duration::from_millis(1_500), "fenced {:?} after etcd went", killed.elapsed());
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(map_word(&endpoint), MapWord { epoch: 4, fenced: true }, "fenced while etcd is down");

    // Back on its data: the lease lives on, the fence goes, the map gets epoch 5.
    server.restart();
    wait_word(&endpoint, "cleared", |w| w == MapWord { epoch: 5, fenced: false });
    // The word goes first, the map after it (registry.rs: a client that reads the word
    // waits for that epoch's map), so the map may still be on its way.
    let etcd = Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let now = loop {
        let (now, _) = etcd.map().unwrap().unwrap();
        if now.epoch != 4 || Instant::now() >= deadline {
            break now;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(now, racekv_coord::ClusterMap { epoch: 5, ..map }, "the same map, a new epoch");
    signal(&child, nix::sys::signal::Signal::SIGTERM);
    assert!(child.wait().unwrap().success());
}
