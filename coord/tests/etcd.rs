//! The coordinator against a real etcd (Debian's `etcd-server`, started here on loopback
//! ports in a temporary directory, stopped by pid): registrations under leases (revoked on
//! drop, expiring when abandoned, back after etcd restarts), the map's compare-and-swap
//! between concurrent writers, the watch through an etcd restart, failover woken by a
//! lapsed lease, and malformed state refused with an error.
#![cfg(all(feature = "etcd", feature = "testing"))]

use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use racekv_coord::etcd::Etcd;
use racekv_coord::testing::{free_port, EtcdServer};
use racekv_coord::{ClusterMap, CoordError, MemnodeInfo};

const TIMEOUT: Duration = Duration::from_secs(5);

fn memnode(node_id: u64) -> MemnodeInfo {
    MemnodeInfo { node_id, endpoints: vec![format!("tcp:127.0.0.1:{}", 7000 + node_id)], region_bytes: 64 << 20 }
}

fn ids(memnodes: &[MemnodeInfo]) -> Vec<u64> {
    memnodes.iter().map(|m| m.node_id).collect()
}

/// Polls `check` for up to `within`.
fn eventually(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    check()
}

#[test]
fn registrations_live_with_their_lease() {
    let server = EtcdServer::start();
    let etcd = Etcd::connect(&server.endpoint(), "leases", TIMEOUT).unwrap();
    let a = etcd.register(&memnode(1), Duration::from_secs(2)).unwrap();
    let b = etcd.register(&memnode(2), Duration::from_secs(2)).unwrap();
    assert_eq!(ids(&etcd.memnodes().unwrap()), vec![1, 2]);
    // Kept alive past several TTLs.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(ids(&etcd.memnodes().unwrap()), vec![1, 2], "keep-alives hold the leases");
    // A clean stop revokes at once.
    drop(a);
    assert_eq!(ids(&etcd.memnodes().unwrap()), vec![2]);
    // A crash (no revoke, no keep-alive) goes when the lease expires.
    b.abandon();
    assert_eq!(ids(&etcd.memnodes().unwrap()), vec![2], "still within its lease");
    assert!(eventually(Duration::from_secs(10), || etcd.memnodes().unwrap().is_empty()), "the lease never expired");
    // Another cluster's keys are its own.
    let other = Etcd::connect(&server.endpoint(), "other", TIMEOUT).unwrap();
    let _c = other.register(&memnode(3), Duration::from_secs(2)).unwrap();
    assert!(etcd.memnodes().unwrap().is_empty());
}

#[test]
fn concurrent_map_writers_agree_on_one_sequence() {
    const WRITERS: usize = 6;
    const ROUNDS: usize = 15;
    let server = EtcdServer::start();
    let etcd = Etcd::connect(&server.endpoint(), "cas", TIMEOUT).unwrap();
    let first = ClusterMap::initial(vec![memnode(1), memnode(2), memnode(3)], 2, 4).unwrap();
    assert!(etcd.map().unwrap().is_none());
    let created = etcd.put_map(&first, None).unwrap().expect("the first map is written");
    assert_eq!(etcd.put_map(&first, None).unwrap(), None, "a second first map loses");
    let watch = etcd.watch_map(created);
    // Each writer bumps the epoch by CAS until it landed ROUNDS times.
    let barrier = Arc::new(Barrier::new(WRITERS));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (endpoint, barrier) = (server.endpoint(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let etcd = Etcd::connect(&endpoint, "cas", TIMEOUT).unwrap();
                barrier.wait();
                let (mut landed, mut lost) = (0, 0);
                while landed < ROUNDS {
                    let (mut map, revision) = etcd.map().unwrap().unwrap();
                    map.epoch += 1;
                    let p = w % map.partitions.len();
                    map.partitions[p].reverse();
                    match etcd.put_map(&map, Some(revision)).unwrap() {
                        Some(_) => landed += 1,
                        None => lost += 1,
                    }
                }
                lost
            })
        })
        .collect();
    let lost: usize = writers.into_iter().map(|t| t.join().unwrap()).sum();
    let (last, _) = etcd.map().unwrap().unwrap();
    assert_eq!(last.epoch, 1 + (WRITERS * ROUNDS) as u64, "no update was lost ({lost} CAS races lost and retried)");
    // The watch saw every epoch, in order, each once.
    let mut epochs = Vec::new();
    while epochs.len() < WRITERS * ROUNDS {
        let (map, _) = watch.next(Duration::from_secs(10)).expect("the watch delivers every map").unwrap();
        epochs.push(map.epoch);
    }
    assert_eq!(epochs, (2..=last.epoch).collect::<Vec<_>>());
}

/// The failover checker learns of a lapsed lease from its watch of the registrations, not
/// its next poll: with a poll of an hour, the map without the memnode still comes once
/// etcd expires the lease (1 s, its expiry tick, a round trip).
#[test]
fn failover_follows_a_lapsed_lease_without_waiting_for_its_poll() {
    let server = EtcdServer::start();
    let etcd = Etcd::connect(&server.endpoint(), "failover", TIMEOUT).unwrap();
    let lease = racekv_coord::etcd::MIN_LEASE;
    let registrations: Vec<_> = (1..=3).map(|id| etcd.register(&memnode(id), lease).unwrap()).collect();
    let map = ClusterMap::initial(vec![memnode(1), memnode(2), memnode(3)], 2, 4).unwrap();
    etcd.put_map(&map, None).unwrap().expect("the first map is written");
    let checker = Etcd::connect(&server.endpoint(), "failover", TIMEOUT).unwrap();
    let _failover = racekv_coord::failover::Failover::start(checker, Duration::from_secs(3600)).unwrap();
    std::thread::sleep(Duration::from_millis(300)); // its first check, then its watch
    let mut registrations = registrations.into_iter();
    registrations.next().unwrap().abandon();
    let failed_over = eventually(Duration::from_secs(10), || {
        let (now, _) = etcd.map().unwrap().unwrap();
        now.epoch > map.epoch && now.partitions.iter().all(|set| !set.contains(&1))
    });
    assert!(failed_over, "memnode 1's lease lapsed, but the map still lists it in replica sets");
}

#[test]
fn etcd_restarts_bring_registrations_and_watches_back() {
    let mut server = EtcdServer::start();
    let etcd = Etcd::connect(&server.endpoint(), "restart", TIMEOUT).unwrap();
    let map = ClusterMap::initial(vec![memnode(1)], 1, 2).unwrap();
    let revision = etcd.put_map(&map, None).unwrap().unwrap();
    let watch = etcd.watch_map(revision);
    let _registration = etcd.register(&memnode(1), Duration::from_secs(1)).unwrap();
    server.kill();
    assert!(matches!(etcd.memnodes(), Err(CoordError::Etcd { .. })), "a call to a dead etcd fails, bounded");
    // Down for longer than the lease: the lease expires with etcd's clock once it is back.
    std::thread::sleep(Duration::from_secs(2));
    server.restart();
    assert!(
        eventually(Duration::from_secs(15), || etcd.memnodes().is_ok_and(|m| ids(&m) == vec![1])),
        "the live memnode registered again"
    );
    let next = ClusterMap { epoch: 2, ..map };
    let (_, current) = etcd.map().unwrap().unwrap();
    etcd.put_map(&next, Some(current)).unwrap().expect("the map is written after the restart");
    let (seen, _) = watch.next(Duration::from_secs(15)).expect("the watch resumed").unwrap();
    assert_eq!(seen.epoch, 2);
}

#[test]
fn malformed_state_in_etcd_is_an_error_not_a_crash() {
    let server = EtcdServer::start();
    let etcd = Etcd::connect(&server.endpoint(), "hostile", TIMEOUT).unwrap();
    // Written behind racekv's back, as any etcd user could.
    let put = |key: &str, value: &[u8]| {
        let status = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &server.endpoint()[0], "put", key])
            .arg(std::str::from_utf8(value).unwrap())
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
    };
    put("/racekv/hostile/map", br#"{"epoch":1,"replicas":9,"memnodes":[],"partitions":[]}"#);
    assert!(matches!(etcd.map(), Err(CoordError::BadMap(_))));
    put("/racekv/hostile/map", b"not json at all");
    assert!(matches!(etcd.map(), Err(CoordError::BadMap(_))));
    put("/racekv/hostile/memnodes/0000000000000001", br#"{"node_id":1,"endpoints":[],"region_bytes":1}"#);
    assert!(matches!(etcd.memnodes(), Err(CoordError::BadMap(_))));
    assert!(Etcd::connect(&server.endpoint(), "Bad Name", TIMEOUT).is_err());
    let unreachable = Etcd::connect(&[format!("http://127.0.0.1:{}", free_port())], "x", Duration::from_millis(500));
    assert!(unreachable.is_err() || unreachable.unwrap().map().is_err(), "nothing listens there");
}
