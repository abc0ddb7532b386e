//! A computenode routing by the cluster map in a real etcd (issue 17, item 1): it connects to
//! the memnodes the map lists, puts each key on its partition's primary (checked key by key
//! on each memnode directly), installs a newer map while serving, refuses one naming a memnode
//! it cannot connect to (and installs the next good one), connects to a memnode a newer map
//! adds and routes its partitions there, and refuses to start on a map
//! whose memnode answers with another node id, or with no map at all. A memnode serving a
//! newer map than the computenode routes by (its map epoch word) makes it wait for that map
//! and route again; when none comes, the command fails with the reason.
#![cfg(feature = "etcd")]

mod common;

use std::time::{Duration, Instant};

use racekv_client::ring::key_hash;
use racekv_client::Client;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_coord::etcd::Etcd;
use racekv_coord::testing::EtcdServer;
use racekv_coord::{ClusterMap, MemnodeInfo};
use racekv_hashing::format::raise_map_epoch;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::TransportKind;
use redis::Commands;

const CLUSTER: &str = "routing-test";

fn info(m: &TestMemnode) -> MemnodeInfo {
    let node_id = racekv_hashing::rpc::metadata(&*m.connect()).unwrap().node_id;
    MemnodeInfo { node_id, endpoints: vec![m.endpoint().unwrap().to_string()], region_bytes: 16 << 20 }
}

/// Routes by the map in `etcd`, which names the memnodes.
fn by_map(etcd: &EtcdServer) -> impl FnOnce(&mut ComputenodeConfig) {
    let endpoints = etcd.endpoint();
    move |c| {
        c.etcd_endpoints = endpoints;
        c.cluster = CLUSTER.into();
    }
}

/// The keys memnode `m` holds, of `keys` (asked of it alone, not through the computenode).
fn held_by(m: &TestMemnode, keys: &[String]) -> Vec<String> {
    let direct =
        Client::builder().memnode(m.endpoint().unwrap().to_string()).token(TestMemnode::TOKEN).connect().unwrap();
    keys.iter().filter(|k| direct.get(k.as_bytes()).unwrap().is_some()).cloned().collect()
}

fn primary_of(map: &ClusterMap, key: &str) -> u64 {
    map.replicas_of(map.partition_of(key_hash(key.as_bytes())))[0]
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn maps_counted(outcome: &str) -> u64 {
    prometheus::gather()
        .iter()
        .filter(|f| f.name() == "racekv_computenode_cluster_maps_total")
        .flat_map(|f| f.get_metric())
        .filter(|m| m.get_label().iter().any(|l| l.value() == outcome))
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

fn set_keys(node: &Computenode, prefix: &str) -> Vec<String> {
    let mut redis =
        redis::Client::open(format!("redis://{}", node.redis_addr().unwrap())).unwrap().get_connection().unwrap();
    let keys: Vec<String> = (0..300).map(|i| format!("{prefix}:{i}")).collect();
    for k in &keys {
        let () = redis.set(k, "v").unwrap();
        let got: String = redis.get(k).unwrap();
        assert_eq!(got, "v");
    }
    keys
}

#[test]
fn keys_go_to_their_partitions_primary_and_newer_maps_are_followed() {
    let server = EtcdServer::start();
    let memnodes: Vec<TestMemnode> =
        (0..3).map(|_| TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16)).collect();
    let etcd = Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap();
    let mut map = ClusterMap::initial(memnodes.iter().map(info).collect(), 1, 4).unwrap();
    let mut revision = etcd.put_map(&map, None).unwrap().unwrap();

    let node = common::redis_only(&[], by_map(&server));
    let status = node.status();
    assert_eq!((status.map_epoch, status.memnodes.len()), (Some(1), 3));
    let keys = set_keys(&node, "first");
    for m in &memnodes {
        let id = info(m).node_id;
        let want: Vec<String> = keys.iter().filter(|k| primary_of(&map, k) == id).cloned().collect();
        assert!(!want.is_empty() && want.len() < keys.len(), "4 partitions per memnode: each gets some keys");
        assert_eq!(held_by(m, &keys), want, "memnode {id:#x} holds exactly its partitions' keys");
    }

    // Epoch 2: every partition's primary is the first memnode.
    let first = info(&memnodes[0]).node_id;
    map.epoch = 2;
    map.partitions.iter_mut().for_each(|set| set[0] = first);
    revision = etcd.put_map(&map, Some(revision)).unwrap().unwrap();
    wait_until("epoch 2 is installed", || node.status().map_epoch == Some(2));
    let later = set_keys(&node, "second");
    assert_eq!(held_by(&memnodes[0], &later), later);

    // Epoch 3 names a memnode this computenode cannot connect to: refused, routing kept.
    let refused_before = maps_counted("refused");
    let stranger = MemnodeInfo { node_id: u64::MAX, endpoints: vec!["tcp:127.0.0.1:1".into()], region_bytes: 1 << 20 };
    map.epoch = 3;
    map.memnodes.push(stranger);
    map.partitions[0][0] = u64::MAX;
    revision = etcd.put_map(&map, Some(revision)).unwrap().unwrap();
    wait_until("epoch 3 is refused", || maps_counted("refused") > refused_before);
    assert_eq!(node.status().map_epoch, Some(2));

    // Epoch 4 is good again: installed (the watch goes on after a refusal).
    map.epoch = 4;
    map.memnodes.pop();
    map.partitions.iter_mut().enumerate().for_each(|(p, set)| set[0] = info(&memnodes[p % 3]).node_id);
    etcd.put_map(&map, Some(revision)).unwrap().unwrap();
    wait_until("epoch 4 is installed", || node.status().map_epoch == Some(4));
    let last = set_keys(&node, "fourth");
    for m in &memnodes {
        let id = info(m).node_id;
        let want: Vec<String> = last.iter().filter(|k| primary_of(&map, k) == id).cloned().collect();
        assert_eq!(held_by(m, &last), want);
    }

    // Epoch 5 adds a memnode (`racekv cluster add-memnode`), primary of every fourth
    // partition: the computenode connects to it while serving, and its keys go there.
    let revision = etcd.map().unwrap().unwrap().1;
    let added = TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16);
    map.epoch = 5;
    map.memnodes.push(info(&added));
    map.memnodes.sort_by_key(|m| m.node_id);
    map.partitions.iter_mut().step_by(4).for_each(|set| set[0] = info(&added).node_id);
    etcd.put_map(&map, Some(revision)).unwrap().unwrap();
    wait_until("epoch 5 is installed", || node.status().map_epoch == Some(5));
    assert_eq!(node.status().memnodes.len(), 4, "connected to the memnode the map added");
    let fifth = set_keys(&node, "fifth");
    for m in memnodes.iter().chain([&added]) {
        let id = info(m).node_id;
        let want: Vec<String> = fifth.iter().filter(|k| primary_of(&map, k) == id).cloned().collect();
        assert!(!want.is_empty());
        assert_eq!(held_by(m, &fifth), want);
    }
    node.shutdown();
}

#[test]
fn a_start_refuses_a_memnode_with_another_node_id_and_a_missing_map() {
    let server = EtcdServer::start();
    let none = Computenode::start(ComputenodeConfig {
        etcd_map_wait_ms: 300,
        ..common::redis_only_config(&[], by_map(&server))
    });
    let e = format!("{:#}", none.err().expect("no map: no start"));
    assert!(e.contains("has no map after 300 ms") && e.contains("racekv cluster init"), "{e}");

    let (a, b) = (
        TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16),
        TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16),
    );
    // The map gives a's node id b's endpoint: a start must not route a's partitions to b.
    let mut wrong = info(&a);
    wrong.endpoints = info(&b).endpoints;
    let map = ClusterMap::initial(vec![wrong], 1, 2).unwrap();
    let etcd = Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap();
    etcd.put_map(&map, None).unwrap().unwrap();
    let e = format!(
        "{:#}",
        Computenode::start(common::redis_only_config(&[], by_map(&server))).err().expect("wrong node id: no start")
    );
    assert!(e.contains("not the one the cluster map gives it"), "{e}");
}

#[test]
fn a_memnode_serving_a_newer_map_makes_the_computenode_route_again() {
    let server = EtcdServer::start();
    let memnodes: Vec<TestMemnode> =
        (0..2).map(|_| TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16)).collect();
    let (a, b) = (info(&memnodes[0]).node_id, info(&memnodes[1]).node_id);
    let etcd = Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap();
    let mut map = ClusterMap::initial(memnodes.iter().map(info).collect(), 1, 4).unwrap();
    let revision = etcd.put_map(&map, None).unwrap().unwrap();
    let tweak = by_map(&server);
    let node = common::redis_only(&[], |c| {
        tweak(c);
        c.op_timeout_ms = 1_000;
    });
    let mut redis =
        redis::Client::open(format!("redis://{}", node.redis_addr().unwrap())).unwrap().get_connection().unwrap();
    let on = |map: &ClusterMap, id: u64| (0..).map(|i| format!("k{i}")).find(|k| primary_of(map, k) == id).unwrap();

    // What a mover does before it moves a's partitions to b: a serves map 2 from now on.
    // The computenode routes by map 1 until the map is written 300 ms later; the SET that
    // meets a's newer epoch waits for it and is done again on b, where map 2 puts the key.
    let key = on(&map, a);
    raise_map_epoch(&*memnodes[0].connect(), 2).unwrap();
    map.epoch = 2;
    map.partitions.iter_mut().for_each(|set| set[0] = b);
    let publish = {
        let (etcd, map) = (Etcd::connect(&server.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap(), map.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            etcd.put_map(&map, Some(revision)).unwrap().unwrap()
        })
    };
    let () = redis.set(&key, "moved").unwrap();
    let revision = publish.join().unwrap();
    assert_eq!(node.status().map_epoch, Some(2));
    let here = std::slice::from_ref(&key);
    assert_eq!(held_by(&memnodes[1], here), here, "done again where map 2 puts it");
    let got: String = redis.get(&key).unwrap();
    assert_eq!(got, "moved");

    // b serves map 3, which never comes: commands on b fail, saying why, within the timeout.
    raise_map_epoch(&*memnodes[1].connect(), 3).unwrap();
    let e = redis.get::<_, Option<String>>(&key).unwrap_err().to_string();
    assert!(e.contains("serves cluster map epoch 3, newer than epoch 2"), "{e}");
    // Once map 3 is written (b keeps its keys), they work again.
    map.epoch = 3;
    etcd.put_map(&map, Some(revision)).unwrap().unwrap();
    wait_until("epoch 3 is installed", || node.status().map_epoch == Some(3));
    let got: String = redis.get(&key).unwrap();
    assert_eq!(got, "moved");
    node.shutdown();
}
