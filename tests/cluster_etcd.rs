//! `racekv cluster init` and `racekv cluster status` against a real etcd and three memnodes
//! registered in it (issue 17, item 1): the first map from the registered memnodes, a
//! second `init` refused, a stopped memnode shown as mapped but without a lease.
#![cfg(feature = "etcd")]

use std::process::Command;

use racekv_coord::testing::EtcdServer;
use racekv_memnode::{Memnode, MemnodeConfig};

const CLUSTER: &str = "cli-test";

fn memnode(etcd: &[String]) -> Memnode {
    let cfg = MemnodeConfig {
        region_bytes: 16 << 20,
        listen_tcp: Some("127.0.0.1:0".into()),
        metrics_addr: None,
        etcd_endpoints: etcd.to_vec(),
        cluster: CLUSTER.into(),
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

    let mut memnodes: Vec<Memnode> = (0..3).map(|_| memnode(&etcd)).collect();
    let init = cluster(&etcd, &["init", "--replicas", "2", "--partitions-per-memnode", "4"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    assert!(String::from_utf8_lossy(&init.stdout).contains("3 memnodes, 12 partitions, 2 replica(s) each"));
    let again = cluster(&etcd, &["init"]);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already has a map"));

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
