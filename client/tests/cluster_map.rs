//! An embedded client routing by the cluster map in a real etcd (issue 17, item 1): its keys
//! land on their partitions' primaries (checked on each memnode directly), it follows a
//! newer map, and a memnode serving a newer map than it routes by makes it wait for that map
//! and do the write again where the map puts the key.
#![cfg(feature = "etcd")]

use std::time::{Duration, Instant};

use racekv_client::ring::key_hash;
use racekv_client::Client;
use racekv_coord::etcd::Etcd;
use racekv_coord::testing::EtcdServer;
use racekv_coord::{ClusterMap, MemnodeInfo};
use racekv_hashing::format::raise_map_epoch;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::TransportKind;

const CLUSTER: &str = "embedded-test";

fn info(m: &TestMemnode) -> MemnodeInfo {
    let node_id = racekv_hashing::rpc::metadata(&*m.connect()).unwrap().node_id;
    MemnodeInfo { node_id, endpoints: vec![m.endpoint().unwrap().to_string()], region_bytes: 16 << 20 }
}

fn direct(m: &TestMemnode) -> Client {
    Client::builder().memnode(m.endpoint().unwrap().to_string()).token(TestMemnode::TOKEN).connect().unwrap()
}

fn primary_of(map: &ClusterMap, key: &str) -> u64 {
    map.replicas_of(map.partition_of(key_hash(key.as_bytes())))[0]
}

#[test]
fn an_embedded_client_routes_by_the_map_and_follows_it() {
    let server = EtcdServer::start();
    let memnodes: Vec<TestMemnode> =
        (0..2).map(|_| TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16)).collect();
    let (a, b) = (info(&memnodes[0]).node_id, info(&memnodes[1]).node_id);
    let etcd = Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap();
    let mut map = ClusterMap::initial(memnodes.iter().map(info).collect(), 1, 4).unwrap();
    let revision = etcd.put_map(&map, None).unwrap().unwrap();
    let client = Client::builder()
        .etcd(server.endpoint(), CLUSTER)
        .token(TestMemnode::TOKEN)
        .timeout(Duration::from_secs(2))
        .connect()
        .unwrap();

    let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
    for k in &keys {
        client.put(k.as_bytes(), b"1").unwrap();
    }
    for (m, id) in memnodes.iter().zip([a, b]) {
        let here = direct(m);
        for k in &keys {
            let held = here.get(k.as_bytes()).unwrap().is_some();
            assert_eq!(held, primary_of(&map, k) == id, "{k} on memnode {id:#x}");
        }
    }

    // a serves map 2 (all partitions on b) before the map is written: a write to one of
    // a's keys waits for it and is done again on b.
    let key = keys.iter().find(|k| primary_of(&map, k) == a).unwrap().clone();
    raise_map_epoch(&*memnodes[0].connect(), 2).unwrap();
    map.epoch = 2;
    map.partitions.iter_mut().for_each(|set| set[0] = b);
    let publish = {
        let (endpoints, map) = (server.endpoint(), map.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let etcd = Etcd::connect(&endpoints, CLUSTER, Duration::from_secs(5)).unwrap();
            etcd.put_map(&map, Some(revision)).unwrap().unwrap();
        })
    };
    let started = Instant::now();
    client.put(key.as_bytes(), b"2").unwrap();
    publish.join().unwrap();
    assert!(started.elapsed() >= Duration::from_millis(250), "the write waited for map 2");
    assert_eq!(direct(&memnodes[1]).get(key.as_bytes()).unwrap().as_deref(), Some(&b"2"[..]));
    assert_eq!(client.get(key.as_bytes()).unwrap().as_deref(), Some(&b"2"[..]));
}

/// Replication (R = 2): a coordinator that dies after deciding, holding a key's locks on
/// its primary and its backup, leaves a key whose value still reaches both replicas: the
/// reader that settles the primary's lock first copies the decision into the backup's
/// participant record, so the backup's lock resolves to it without the primary's memnode
/// (as it must once that one is gone). One that dies undecided is aborted, and the next
/// write of the key, which meets the backup's lock, resolves it too.
#[test]
fn a_dead_coordinators_replicated_write_settles_on_every_replica() {
    use racekv_hashing::layout::TxnMark;
    use racekv_hashing::table::txn::{RecordLinks, TxnState, TXN_LEASE_MS};
    use racekv_hashing::TableOptions;

    for decided in [Some(TxnState::Committed), None] {
        let server = EtcdServer::start();
        let memnodes: Vec<TestMemnode> =
            (0..2).map(|_| TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16)).collect();
        let (a, b) = (info(&memnodes[0]).node_id, info(&memnodes[1]).node_id);
        let map = ClusterMap::initial(memnodes.iter().map(info).collect(), 2, 4).unwrap();
        let etcd = Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap();
        etcd.put_map(&map, None).unwrap().unwrap();
        let client = Client::builder()
            .etcd(server.endpoint(), CLUSTER)
            .token(TestMemnode::TOKEN)
            .timeout(Duration::from_secs(5))
            .connect()
            .unwrap();
        let key = (0..).map(|i| format!("r{i}")).find(|k| primary_of(&map, k) == a).unwrap();
        let key = key.as_bytes();
        client.put(key, b"old").unwrap();
        assert_eq!(direct(&memnodes[1]).get(key).unwrap().as_deref(), Some(&b"old"[..]), "on the backup too");

        // The coordinator, by hand: the home record on the primary, a participant record on
        // the backup, the key locked on both, maybe the decision; then it "dies".
        let options = TableOptions { grace_period: Duration::ZERO, ..TableOptions::default() };
        let (table_a, table_b) = (memnodes[0].table(options), memnodes[1].table(options));
        let (mut p, mut q) = (table_a.client(memnodes[0].connect()), table_b.client(memnodes[1].connect()));
        let deadline_ms = racekv_hashing::clock::now_unix_ms() + TXN_LEASE_MS;
        let home = p.txn_record(deadline_ms, &RecordLinks::Home(vec![(0, 0)])).unwrap();
        let participant =
            q.txn_record(deadline_ms, &RecordLinks::Participant { home_node: a, home_offset: home }).unwrap();
        p.txn_relink_record(home, deadline_ms, &RecordLinks::Home(vec![(b, participant)]));
        for (c, node, record) in [(&mut p, a, home), (&mut q, b, participant)] {
            let (_, word) = c.read_versioned(key).unwrap();
            let mark =
                TxnMark { record_node: node, record_offset: record, old_word: word, deadline_ms, tombstone: false };
            assert!(c.txn_lock(key, Some(b"new"), None, mark).unwrap().is_some());
        }
        if let Some(to) = decided {
            assert_eq!(p.txn_decide(home, deadline_ms, to).unwrap(), Some(to));
        }
        p.flush().unwrap();
        q.flush().unwrap();
        std::mem::forget((p, q, table_a, table_b));

        let expected: &[u8] = if decided.is_some() { b"new" } else { b"old" };
        assert_eq!(client.get(key).unwrap().as_deref(), Some(expected), "{decided:?}");
        if decided.is_some() {
            // A client of the backup alone (which cannot reach the home record) resolves
            // the backup's lock from its participant record.
            assert_eq!(direct(&memnodes[1]).get(key).unwrap().as_deref(), Some(expected));
        }
        client.put(key, b"after").unwrap();
        for m in &memnodes {
            assert_eq!(direct(m).get(key).unwrap().as_deref(), Some(&b"after"[..]), "{decided:?}");
        }
    }
}
