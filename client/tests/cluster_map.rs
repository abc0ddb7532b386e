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
