//! Replicated writes (issue 17, item 2): with a cluster map of R = 2 over three real
//! memnodes in a real etcd, every write through the computenode's Redis front end lands on
//! both replicas of its key's partition and on no other memnode (checked on each memnode
//! directly), deletes and expiry changes too; DBSIZE and SCAN count each key once; and
//! writers racing on a few keys from many threads leave every key's replicas equal to what
//! its primary serves.
#![cfg(feature = "etcd")]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use racekv_client::ring::key_hash;
use racekv_client::Client;
use racekv_computenode::Computenode;
use racekv_coord::etcd::Etcd;
use racekv_coord::testing::EtcdServer;
use racekv_coord::{ClusterMap, MemnodeInfo};
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::TransportKind;
use redis::Commands;

const CLUSTER: &str = "replication-test";

struct Cluster {
    _etcd: EtcdServer,
    memnodes: Vec<TestMemnode>,
    /// One client per memnode, reading its table alone.
    direct: Vec<Client>,
    ids: Vec<u64>,
    map: ClusterMap,
    node: Computenode,
}

impl Cluster {
    fn start(replicas: u8) -> Self {
        let etcd = EtcdServer::start();
        let memnodes: Vec<TestMemnode> =
            (0..3).map(|_| TestMemnode::start(Via::Transport(TransportKind::Shm), 32 << 20, 32)).collect();
        let infos: Vec<MemnodeInfo> = memnodes
            .iter()
            .map(|m| {
                let node_id = racekv_hashing::rpc::metadata(&*m.connect()).unwrap().node_id;
                MemnodeInfo { node_id, endpoints: vec![m.endpoint().unwrap().to_string()], region_bytes: 32 << 20 }
            })
            .collect();
        let ids = infos.iter().map(|i| i.node_id).collect();
        let map = ClusterMap::initial(infos, replicas, 4).unwrap();
        Etcd::connect(&etcd.endpoint(), CLUSTER, Duration::from_secs(5)).unwrap().put_map(&map, None).unwrap().unwrap();
        let endpoints = etcd.endpoint();
        let node = common::redis_only(&[], |c| {
            c.etcd_endpoints = endpoints;
            c.cluster = CLUSTER.into();
        });
        let direct = memnodes
            .iter()
            .map(|m| {
                Client::builder()
                    .memnode(m.endpoint().unwrap().to_string())
                    .token(TestMemnode::TOKEN)
                    .connect()
                    .unwrap()
            })
            .collect();
        Self { _etcd: etcd, memnodes, direct, ids, map, node }
    }

    fn redis(&self) -> redis::Connection {
        redis::Client::open(format!("redis://{}", self.node.redis_addr().unwrap())).unwrap().get_connection().unwrap()
    }

    /// Indexes (into `memnodes`) of the replicas of `key`'s partition, the primary first.
    fn replicas_of(&self, key: &str) -> Vec<usize> {
        let set = self.map.replicas_of(self.map.partition_of(key_hash(key.as_bytes())));
        set.iter().map(|id| self.ids.iter().position(|x| x == id).unwrap()).collect()
    }

    /// What each memnode holds for `key`, read from it alone.
    fn copies(&self, key: &str) -> Vec<Option<Vec<u8>>> {
        self.direct.iter().map(|d| d.get(key.as_bytes()).unwrap()).collect()
    }

    /// `key` is `value` (None: absent) on every replica and absent elsewhere.
    fn assert_replicated(&self, key: &str, value: Option<&[u8]>) {
        let replicas = self.replicas_of(key);
        for (i, copy) in self.copies(key).iter().enumerate() {
            let want = if replicas.contains(&i) { value } else { None };
            assert_eq!(copy.as_deref(), want, "{key} on memnode #{i} (replicas {replicas:?})");
        }
    }
}

#[test]
fn every_write_lands_on_each_replica_of_its_partition() {
    let c = Cluster::start(2);
    assert_eq!(c.memnodes.len(), 3);
    let mut redis = c.redis();
    let keys: Vec<String> = (0..200).map(|i| format!("key:{i}")).collect();
    for k in &keys {
        let () = redis.set(k, format!("{k}=1")).unwrap();
    }
    for k in &keys {
        assert_eq!(c.replicas_of(k).len(), 2);
        c.assert_replicated(k, Some(format!("{k}=1").as_bytes()));
    }
    let dbsize: u64 = redis::cmd("DBSIZE").query(&mut redis).unwrap();
    assert_eq!(dbsize, 200, "each key counted once, not once per replica");
    let mut scanned = BTreeSet::new();
    let mut returned = 0;
    for key in redis.scan::<String>().unwrap() {
        returned += 1;
        scanned.insert(key.unwrap());
    }
    assert_eq!((scanned.len(), returned), (200, 200), "SCAN returns each key once");

    // Overwrites, conditional sets, deletes, counters, expiry: the replicas follow.
    let () = redis.set("key:0", "second").unwrap();
    c.assert_replicated("key:0", Some(b"second"));
    let set: bool =
        redis::cmd("SET").arg("key:1").arg("nx").arg("NX").query::<Option<String>>(&mut redis).unwrap().is_some();
    assert!(!set, "SET NX of a present key does nothing");
    c.assert_replicated("key:1", Some(b"key:1=1"));
    let old: Option<String> = redis::cmd("SET").arg("key:1").arg("third").arg("GET").query(&mut redis).unwrap();
    assert_eq!(old.as_deref(), Some("key:1=1"));
    c.assert_replicated("key:1", Some(b"third"));
    let removed: u64 = redis.del("key:2").unwrap();
    assert_eq!(removed, 1);
    c.assert_replicated("key:2", None);
    for _ in 0..5 {
        let _: i64 = redis.incr("counter", 1).unwrap();
    }
    c.assert_replicated("counter", Some(b"5"));
    let _: bool = redis.expire("key:3", 1000).unwrap();
    for i in c.replicas_of("key:3") {
        let ttl = c.direct[i].get_item(b"key:3").unwrap().unwrap().expires_at_ms;
        assert!(ttl.is_some(), "the expiry is on memnode #{i} too");
    }
    let _: bool = redis.persist("key:3").unwrap();
    for i in c.replicas_of("key:3") {
        assert_eq!(c.direct[i].get_item(b"key:3").unwrap().unwrap().expires_at_ms, None);
    }
    let () = redis::pipe()
        .atomic()
        .set("key:4", "in a transaction")
        .del("key:5")
        .set("new-key", "also")
        .query(&mut redis)
        .unwrap();
    c.assert_replicated("key:4", Some(b"in a transaction"));
    c.assert_replicated("key:5", None);
    c.assert_replicated("new-key", Some(b"also"));
    let () = redis::cmd("MSET").arg("m1").arg("a").arg("m2").arg("b").query(&mut redis).unwrap();
    c.assert_replicated("m1", Some(b"a"));
    c.assert_replicated("m2", Some(b"b"));
}

#[test]
fn racing_writers_leave_the_replicas_equal_to_the_primary() {
    let c = Cluster::start(3);
    let keys: Vec<String> = (0..8).map(|i| format!("hot:{i}")).collect();
    std::thread::scope(|s| {
        for t in 0..6 {
            let (c, keys) = (&c, &keys);
            s.spawn(move || {
                let mut redis = c.redis();
                for i in 0..150usize {
                    let key = &keys[(i * 7 + t) % keys.len()];
                    match i % 5 {
                        0 => {
                            let _: u64 = redis.del(key).unwrap();
                        }
                        1 => {
                            let _: i64 = redis.append(key, "+").unwrap();
                        }
                        _ => {
                            let () = redis.set(key, format!("t{t}-{i}")).unwrap();
                        }
                    }
                }
            });
        }
    });
    let mut redis = c.redis();
    for key in &keys {
        let served: Option<Vec<u8>> = redis.get(key).unwrap();
        assert_eq!(c.replicas_of(key).len(), 3);
        c.assert_replicated(key, served.as_deref());
    }
}
