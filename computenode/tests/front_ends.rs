//! The client library's attached and remote modes against a real computenode (in-process)
//! and a real memnode: every operation, many threads, and clear errors.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

#[path = "../../client/tests/shared/expiry.rs"]
mod expiry_exercise;

use expiry_exercise::exercise_expiry;
use racekv_client::{Client, ClientError, Mode};
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::TransportKind;

fn node(m: &TestMemnode, dir: &std::path::Path) -> Computenode {
    Computenode::start(ComputenodeConfig {
        memnodes: vec![m.endpoint().unwrap().to_string()],
        token: TestMemnode::TOKEN.into(),
        requirepass: Some(PASSWORD.into()),
        redis_addr: None,
        metrics_addr: None,
        remote_addr: Some("127.0.0.1:0".into()),
        attach_socket: Some(dir.join("computenode.sock")),
        ..ComputenodeConfig::default()
    })
    .unwrap()
}

const PASSWORD: &str = "remote secret";

fn exercise(client: &Client) {
    client.put(b"a", b"1").unwrap();
    assert_eq!(client.get(b"a").unwrap().as_deref(), Some(&b"1"[..]));
    assert!(!client.insert(b"a", b"x").unwrap());
    assert!(client.update(b"a", b"2").unwrap());
    assert!(client.compare_and_swap(b"a", Some(b"2"), Some(b"3")).unwrap());
    assert!(!client.compare_and_swap(b"a", Some(b"2"), Some(b"4")).unwrap());
    assert!(client.delete(b"a").unwrap());
    assert_eq!(client.get(b"a").unwrap(), None);
    // Past a block's limit the value goes to an extent, and past one ring slot or RPC it
    // travels in parts; past the table's limit, a typed error.
    let big = vec![5u8; 9 << 20];
    client.put(b"big", &big).unwrap();
    assert_eq!(client.get(b"big").unwrap(), Some(big));
    assert!(client.delete(b"big").unwrap());
    let over = vec![0u8; racekv_client::op::MAX_VALUE_BYTES + 1];
    assert!(matches!(client.put(b"big", &over), Err(ClientError::TooLarge { .. })));
    let pairs: Vec<(Vec<u8>, Vec<u8>)> =
        (0..5_000u32).map(|i| (format!("m{i}").into_bytes(), i.to_le_bytes().to_vec())).collect();
    let refs: Vec<(&[u8], &[u8])> = pairs.iter().map(|(k, v)| (&k[..], &v[..])).collect();
    client.multi_put(&refs).unwrap();
    let keys: Vec<&[u8]> = pairs.iter().map(|(k, _)| &k[..]).chain([&b"missing"[..]]).collect();
    let values = client.multi_get(&keys).unwrap();
    assert_eq!(values.len(), 5_001);
    assert!(values[..5_000].iter().zip(&pairs).all(|(v, (_, want))| v.as_ref() == Some(want)));
    assert_eq!(values[5_000], None);
    std::thread::scope(|s| {
        for t in 0..8 {
            s.spawn(move || {
                for i in 0..300 {
                    let key = format!("t{t}-{i}");
                    client.put(key.as_bytes(), key.as_bytes()).unwrap();
                    assert_eq!(client.get(key.as_bytes()).unwrap().as_deref(), Some(key.as_bytes()));
                }
            });
        }
    });
    assert_eq!(client.len().unwrap(), 5_000 + 8 * 300);
    assert_eq!(client.memnodes().len(), 1);
}

/// Every key of one SCAN walk with pages of about `count` keys.
fn scan_all(client: &Client, count: usize) -> Vec<Vec<u8>> {
    let (mut keys, mut cursor) = (Vec::new(), 0u64);
    for _ in 0..1_000_000 {
        let (next, page) = client.scan(cursor, count).unwrap();
        keys.extend(page);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
    panic!("the walk did not end");
}

/// SCAN, RANDOMKEY and deleting everything, after [`exercise`] left its keys.
fn walk_keyspace(client: &Client) {
    let expected: HashSet<Vec<u8>> = (0..5_000u32)
        .map(|i| format!("m{i}").into_bytes())
        .chain((0..8).flat_map(|t| (0..300).map(move |i| format!("t{t}-{i}").into_bytes())))
        .collect();
    for count in [10, 1_000, 4_096] {
        let keys = scan_all(client, count);
        let unique: HashSet<Vec<u8>> = keys.iter().cloned().collect();
        assert_eq!(unique.len(), keys.len(), "COUNT {count}: a quiet walk returned a key twice");
        assert_eq!(unique, expected, "COUNT {count}");
    }
    for _ in 0..10 {
        assert!(expected.contains(&client.random_key().unwrap().expect("keys exist")));
    }
    assert_eq!(client.delete_all().unwrap(), expected.len() as u64);
    assert_eq!(client.len().unwrap(), 0);
    assert!(scan_all(client, 100).is_empty());
    assert_eq!(client.random_key().unwrap(), None);
}

/// Keys present for a whole walk through the daemon are all returned while other threads
/// insert (splitting the table: subtables of 84 slots), update and delete other keys.
#[test]
fn attached_scans_return_stable_keys_while_the_table_splits() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 128 << 20, 4);
    let dir = tempfile::tempdir().unwrap();
    let node = node(&m, dir.path());
    let socket = node.status().attach_socket.expect("the daemon serves its attach socket");
    let client = Client::builder().attach(&socket).connect().unwrap();
    let stable: HashSet<Vec<u8>> = (0..500u32).map(|i| format!("stable-{i}").into_bytes()).collect();
    for k in &stable {
        client.put(k, b"v").unwrap();
    }
    let depth = m.stats().global_depth;
    let stop = AtomicBool::new(false);
    let walks = AtomicU64::new(0);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..2u32)
            .map(|w| {
                let client = &client;
                s.spawn(move || {
                    for i in 0..4_000u32 {
                        client.put(format!("w{w}-{i}").as_bytes(), b"x").unwrap();
                        if i % 4 == 0 {
                            client.put(format!("w{w}-{}", i / 2).as_bytes(), b"y").unwrap();
                            client.delete(format!("w{w}-{}", i / 3).as_bytes()).unwrap();
                        }
                    }
                })
            })
            .collect();
        let scanner = s.spawn(|| {
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let count = [5, 100, 4_096][n % 3];
                let got: HashSet<Vec<u8>> = scan_all(&client, count).into_iter().collect();
                let missed = stable.difference(&got).count();
                assert_eq!(missed, 0, "walk {n} (COUNT {count}) missed {missed} stable keys");
                walks.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
        });
        for w in writers {
            w.join().unwrap();
        }
        let seen = walks.load(Ordering::Relaxed);
        while walks.load(Ordering::Relaxed) < seen + 1 && !scanner.is_finished() {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(m.stats().global_depth >= depth + 3, "the writers should have split the table");
    assert!(walks.load(Ordering::Relaxed) >= 2);
    // Quiet: DBSIZE counts what a walk finds.
    let keys: HashSet<Vec<u8>> = scan_all(&client, 1_000).into_iter().collect();
    assert_eq!(client.len().unwrap(), keys.len() as u64);
}

#[test]
fn remote_mode_runs_every_operation() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 64 << 20, 64);
    let dir = tempfile::tempdir().unwrap();
    let node = node(&m, dir.path());
    let addr = node.remote_endpoint().unwrap();
    let remote = addr.trim_start_matches("tcp:");
    let client = Client::builder().remote(remote).password(PASSWORD).connect().unwrap();
    assert_eq!(client.mode(), Mode::Remote);
    exercise(&client);
    walk_keyspace(&client);
    exercise_expiry(&client);
    // A wrong password, the memnodes' token, or no password: refused with a clear error.
    for attempt in
        [Client::builder().password("wrong"), Client::builder().password(TestMemnode::TOKEN), Client::builder()]
    {
        let err = attempt.remote(remote).connect().err().unwrap();
        assert!(err.to_string().contains("could not prove it knows the token or password"), "{err}");
    }
    // The computenode going away is a retryable error, not a hang.
    drop(node);
    let err = (0..50).find_map(|_| {
        std::thread::sleep(Duration::from_millis(20));
        client.get(b"m1").err()
    });
    assert!(err.expect("calls kept succeeding after the computenode stopped").is_transient());
}

#[test]
fn attached_mode_reaches_the_daemons_socket() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 64 << 20, 64);
    let dir = tempfile::tempdir().unwrap();
    let node = node(&m, dir.path());
    let socket = node.status().attach_socket.expect("the daemon serves its attach socket");
    let client = Client::builder().attach(&socket).connect().unwrap();
    assert_eq!(client.mode(), Mode::Attached);
    exercise(&client);
    walk_keyspace(&client);
    exercise_expiry(&client);
    assert_eq!(node.status().attached_clients, Some(1));
}
