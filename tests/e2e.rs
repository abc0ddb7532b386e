//! End to end: a memnode and clients on one transport, writers racing splits, readers beside
//! them; then every acknowledged write must be there. Runs on shm and tcp everywhere and on
//! verbs in an `rdma` build (the Soft-RoCE VM, ops/vm).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use racekv_client::Client;
use racekv_memnode::{Memnode, MemnodeConfig};
use racekv_transport::TransportKind;

const TOKEN: &str = "e2e-token";

fn memnode(kind: TransportKind, dir: &std::path::Path) -> Memnode {
    let mut cfg = MemnodeConfig {
        region_bytes: 64 << 20,
        groups_per_subtable: 8,
        listen_tcp: None,
        metrics_addr: None,
        token: TOKEN.into(),
        ..MemnodeConfig::default()
    };
    match kind {
        TransportKind::Shm => cfg.listen_shm = Some(dir.join("memnode.sock")),
        TransportKind::Tcp => cfg.listen_tcp = Some("127.0.0.1:0".into()),
        TransportKind::Verbs => cfg.listen_verbs = Some("127.0.0.1:0".into()),
    }
    Memnode::start(cfg).expect("memnode starts")
}

fn concurrent_upserts_during_splits(kind: TransportKind) {
    let dir = tempfile::tempdir().unwrap();
    let m = memnode(kind, dir.path());
    let client = Client::builder()
        .memnode(m.endpoints()[0].to_string())
        .token(TOKEN)
        .timeout(Duration::from_secs(30))
        .connect()
        .unwrap();
    const WRITERS: u32 = 4;
    const ROUNDS: u32 = 400;
    let stop = AtomicBool::new(false);
    let finals: Vec<Vec<(String, String)>> = std::thread::scope(|s| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (client, stop) = (client.clone(), &stop);
                s.spawn(move || {
                    let mut i = 0u32;
                    while !stop.load(Ordering::Relaxed) {
                        // Hot keys: written by their owner only, so any value read must be one
                        // the owner wrote for that key.
                        let (w, k) = (i % WRITERS, i % 16);
                        if let Some(v) = client.get(format!("hot-{w}-{k}").as_bytes()).unwrap() {
                            let v = String::from_utf8(v).unwrap();
                            assert!(v.starts_with(&format!("hot-{w}-{k}=")), "read {v:?} for hot-{w}-{k}");
                        }
                        i += 1;
                    }
                })
            })
            .collect();
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let client = client.clone();
                s.spawn(move || {
                    let mut last = Vec::new();
                    for r in 0..ROUNDS {
                        // A fresh key every round keeps the table splitting...
                        let fresh = format!("fresh-{w}-{r}");
                        client.put(fresh.as_bytes(), fresh.as_bytes()).unwrap();
                        last.push((fresh.clone(), fresh));
                        // ...while the same 16 hot keys are upserted over and over.
                        let hot = format!("hot-{w}-{}", r % 16);
                        let value = format!("{hot}={r}");
                        client.put(hot.as_bytes(), value.as_bytes()).unwrap();
                        if r + 16 >= ROUNDS {
                            last.push((hot, value));
                        }
                    }
                    last
                })
            })
            .collect();
        let finals = writers.into_iter().map(|h| h.join().unwrap()).collect();
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        finals
    });
    let stats = m.stats().unwrap();
    assert!(stats.global_depth >= 3, "the table should have split repeatedly: {stats:?}");
    let mut expected = 0;
    for (key, value) in finals.iter().flatten() {
        assert_eq!(
            client.get(key.as_bytes()).unwrap().as_deref(),
            Some(value.as_bytes()),
            "acknowledged write to {key} lost"
        );
        expected += 1;
    }
    assert_eq!(client.len().unwrap(), expected as u64, "item count");
    assert!(expected as u32 == WRITERS * (ROUNDS + 16));
}

#[test]
fn shm_concurrent_upserts_during_splits() {
    concurrent_upserts_during_splits(TransportKind::Shm);
}

#[test]
fn tcp_concurrent_upserts_during_splits() {
    concurrent_upserts_during_splits(TransportKind::Tcp);
}

#[cfg(feature = "rdma")]
#[test]
fn verbs_concurrent_upserts_during_splits() {
    concurrent_upserts_during_splits(TransportKind::Verbs);
}

/// Through a computenode: its workers' attached sessions race splits with upserts.
fn through_a_computenode(kind: TransportKind) {
    let dir = tempfile::tempdir().unwrap();
    let m = memnode(kind, dir.path());
    let node = racekv_computenode::Computenode::start(racekv_computenode::config::ComputenodeConfig {
        memnodes: vec![m.endpoints()[0].to_string()],
        token: TOKEN.into(),
        redis_addr: None,
        remote_addr: None,
        attach_socket: None,
        metrics_addr: None,
        ..Default::default()
    })
    .unwrap();
    let written: Vec<Vec<(String, String)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|w| {
                let node = &node;
                s.spawn(move || {
                    let mut session = node.attach();
                    let mut last = std::collections::HashMap::new();
                    for r in 0..300u32 {
                        let fresh = format!("cn-fresh-{w}-{r}");
                        session.put(fresh.as_bytes(), fresh.as_bytes()).unwrap();
                        last.insert(fresh.clone(), fresh);
                        let hot = format!("cn-hot-{w}-{}", r % 8);
                        let value = format!("{r}");
                        session.put(hot.as_bytes(), value.as_bytes()).unwrap();
                        last.insert(hot, value);
                    }
                    last.into_iter().collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(m.stats().unwrap().global_depth >= 3, "the table should have split");
    let mut session = node.attach();
    for (key, value) in written.iter().flatten() {
        assert_eq!(session.get(key.as_bytes()).unwrap().as_deref(), Some(value.as_bytes()), "{key}");
    }
    assert_eq!(session.len().unwrap(), written.iter().map(Vec::len).sum::<usize>() as u64);
}

#[test]
fn tcp_through_a_computenode() {
    through_a_computenode(TransportKind::Tcp);
}

#[cfg(feature = "rdma")]
#[test]
fn verbs_through_a_computenode() {
    through_a_computenode(TransportKind::Verbs);
}
