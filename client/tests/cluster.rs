//! The client against several in-process memnodes on real transports.

#[path = "shared/expiry.rs"]
mod expiry_exercise;

use std::collections::HashMap;
use std::time::Duration;

use racekv_client::{Client, ClientError};
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::TransportKind;

fn cluster(n: usize, kind: TransportKind) -> (Vec<TestMemnode>, Client) {
    let memnodes: Vec<_> = (0..n).map(|_| TestMemnode::start(Via::Transport(kind), 16 << 20, 16)).collect();
    let client = Client::builder()
        .memnodes(memnodes.iter().map(|m| m.endpoint().unwrap().to_string()))
        .token(TestMemnode::TOKEN)
        .timeout(Duration::from_secs(5))
        .connect()
        .unwrap();
    (memnodes, client)
}

#[test]
fn keys_spread_over_memnodes_and_every_operation_works() {
    let (memnodes, client) = cluster(3, TransportKind::Tcp);
    let mut model = HashMap::new();
    for i in 0..3_000u32 {
        let (k, v) = (format!("key-{i}"), format!("value-{i}"));
        client.put(k.as_bytes(), v.as_bytes()).unwrap();
        model.insert(k, v);
    }
    for m in &memnodes {
        let items = m.stats().items;
        assert!((700..1_300).contains(&items), "uneven spread: {items} of 3000 on one memnode");
    }
    assert_eq!(client.len().unwrap(), 3_000);
    assert!(!client.insert(b"key-1", b"x").unwrap());
    assert!(client.insert(b"fresh", b"x").unwrap());
    assert!(client.update(b"fresh", b"y").unwrap());
    assert!(!client.update(b"never", b"y").unwrap());
    assert!(client.compare_and_swap(b"fresh", Some(b"y"), Some(b"z")).unwrap());
    assert!(!client.compare_and_swap(b"fresh", Some(b"y"), Some(b"w")).unwrap());
    assert!(client.delete(b"fresh").unwrap());
    let names: Vec<String> = (0..3_100u32).map(|i| format!("key-{i}")).collect();
    let keys: Vec<&[u8]> = names.iter().map(|n| n.as_bytes()).collect();
    let values = client.multi_get(&keys).unwrap();
    for (name, value) in names.iter().zip(values) {
        assert_eq!(value.map(|v| String::from_utf8(v).unwrap()), model.get(name).cloned(), "{name}");
    }
    let pairs: Vec<(Vec<u8>, Vec<u8>)> =
        (0..500u32).map(|i| (format!("mp-{i}").into_bytes(), vec![i as u8; 10])).collect();
    let refs: Vec<(&[u8], &[u8])> = pairs.iter().map(|(k, v)| (&k[..], &v[..])).collect();
    client.multi_put(&refs).unwrap();
    for (k, v) in &pairs {
        assert_eq!(client.get(k).unwrap().as_ref(), Some(v));
    }
}

#[test]
fn expiry_works_across_memnodes() {
    let (_memnodes, client) = cluster(3, TransportKind::Tcp);
    expiry_exercise::exercise_expiry(&client);
}

#[test]
fn threads_share_a_client() {
    let (_memnodes, client) = cluster(2, TransportKind::Shm);
    std::thread::scope(|s| {
        for t in 0..8 {
            let client = client.clone();
            s.spawn(move || {
                for i in 0..500 {
                    let key = format!("t{t}-{i}");
                    client.put(key.as_bytes(), key.as_bytes()).unwrap();
                    assert_eq!(client.get(key.as_bytes()).unwrap().as_deref(), Some(key.as_bytes()));
                }
            });
        }
    });
    assert_eq!(client.len().unwrap(), 4_000);
}

#[test]
fn errors_are_typed_and_clear() {
    let (mut memnodes, client) = cluster(1, TransportKind::Tcp);
    assert!(matches!(client.put(b"", b"x"), Err(ClientError::EmptyKey)));
    let long_key = vec![b'k'; racekv_hashing::layout::MAX_KEY_BYTES + 1];
    let e = client.put(&long_key, &vec![0u8; 20_000]).unwrap_err();
    assert!(matches!(e, ClientError::TooLarge { .. }), "{e}");
    client.put(b"k", &vec![0u8; 20_000]).unwrap(); // a large value: in an extent
    memnodes[0].stop();
    let err = (0..50).find_map(|_| {
        std::thread::sleep(Duration::from_millis(20));
        client.get(b"k").err()
    });
    let err = err.expect("operations kept succeeding after the memnode stopped");
    assert!(err.is_transient(), "{err}");
    assert!(err.to_string().contains("unavailable"), "{err}");
}

#[test]
fn the_same_memnode_twice_is_refused() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16);
    let endpoint = m.endpoint().unwrap().to_string();
    let err =
        Client::builder().memnode(&endpoint).memnode(&endpoint).token(TestMemnode::TOKEN).connect().err().unwrap();
    assert!(matches!(err, ClientError::Config(_)), "{err}");
    // No memnodes and no socket: attached mode on the default socket, which fails with an
    // error naming it unless a computenode happens to listen there.
    match Client::builder().connect() {
        Err(e) => assert!(e.to_string().contains(&racekv_client::default_attach_socket().display().to_string()), "{e}"),
        Ok(c) => assert_eq!(c.mode(), racekv_client::Mode::Attached),
    }
}

#[test]
fn a_dropped_client_publishes_its_item_count() {
    // A short-lived process (one CLI command) must leave the count right: its sessions,
    // with their pending item-count changes, go when the client goes.
    let (memnodes, client) = cluster(1, TransportKind::Tcp);
    for i in 0..10 {
        client.put(format!("k{i}").as_bytes(), b"v").unwrap();
    }
    let other = client.clone();
    drop(client);
    other.put(b"k10", b"v").unwrap();
    drop(other);
    assert_eq!(memnodes[0].stats().items, 11, "a dropped client left its item count unpublished");
}

#[test]
fn prepare_fetches_a_chunk_from_every_memnode_ahead_of_the_first_write() {
    let (memnodes, client) = cluster(3, TransportKind::Tcp);
    let chunks = || memnodes.iter().map(|m| m.stats().heap.chunks).collect::<Vec<_>>();
    let before = chunks();
    client.prepare().unwrap();
    let prepared = chunks();
    for (b, p) in before.iter().zip(&prepared) {
        assert_eq!(*p, b + 1, "prepare should fetch one chunk per memnode: {before:?} -> {prepared:?}");
    }
    client.prepare().unwrap();
    for i in 0..300u32 {
        client.put(format!("key-{i}").as_bytes(), b"v").unwrap();
    }
    assert_eq!(chunks(), prepared, "a prepared client fetched chunks again for its first writes");
}

/// Every key of one walk of `client.scan` with pages of about `count` keys.
fn scan_all(client: &Client, count: usize) -> Vec<Vec<u8>> {
    let (mut keys, mut cursor) = (Vec::new(), 0u64);
    for _ in 0..1_000_000 {
        let (next, page) = client.scan(cursor, count).unwrap();
        assert!(page.len() <= racekv_client::op::MAX_MULTI);
        keys.extend(page);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
    panic!("the walk did not end");
}

/// A walk's first step on the first memnode that meets a split in progress returns the
/// cursor unmoved; cursor 0 would end the walk there, so the session waits the split out.
#[test]
fn a_walk_that_starts_in_a_split_is_not_ended_by_cursor_zero() {
    use racekv_hashing::hash::KeyHash;
    use racekv_hashing::rpc::SplitRequest;
    use racekv_hashing::TableOptions;

    let (memnodes, client) = cluster(1, TransportKind::Tcp);
    let keys: Vec<Vec<u8>> = (0..100u32).map(|i| format!("k{i}").into_bytes()).collect();
    for k in &keys {
        client.put(k, b"v").unwrap();
    }
    let options = TableOptions { grace_period: Duration::from_millis(2), op_timeout: Duration::from_secs(5) };
    let table = memnodes[0].table(options);
    assert_eq!(table.directory().global_depth(), 0, "no split yet");
    let subtable = table.directory().lookup(0).entry.subtable;
    let splitter = memnodes[0].local_splitter();
    let dir_hash = KeyHash::of(&keys[0], 16).dir;
    // Bucket 0 claimed, the rest waiting: a scan at position 0 cannot move until recovery.
    splitter.split_then_crash(&SplitRequest { dir_hash, observed_depth: 0, observed_subtable: subtable }, 1).unwrap();
    let got: std::collections::HashSet<Vec<u8>> = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(500));
            assert!(splitter.recover().unwrap());
        });
        // COUNT 1000: the first run spans claimed and unclaimed buckets, so it waits.
        scan_all(&client, 1_000).into_iter().collect()
    });
    for k in &keys {
        assert!(got.contains(k), "{} was never returned", String::from_utf8_lossy(k));
    }
}

/// SCAN over several memnodes: every key exactly once on a quiet cluster, and every key
/// present for a whole walk while other threads insert (splitting the tables), update and
/// delete other keys. Then RANDOMKEY and deleting everything.
#[test]
fn scans_cover_every_memnode_while_others_write() {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let (memnodes, client) = cluster(3, TransportKind::Tcp);
    let stable: HashSet<Vec<u8>> = (0..600u32).map(|i| format!("stable-{i}").into_bytes()).collect();
    for k in &stable {
        client.put(k, b"v").unwrap();
    }
    for count in [1, 10, 1_000, 100_000] {
        let keys = scan_all(&client, count);
        let unique: HashSet<Vec<u8>> = keys.iter().cloned().collect();
        assert_eq!(unique.len(), keys.len(), "COUNT {count}: a quiet walk returned a key twice");
        assert_eq!(unique, stable, "COUNT {count}");
    }
    let depths: Vec<u32> = memnodes.iter().map(|m| m.stats().global_depth).collect();
    let stop = AtomicBool::new(false);
    let walks = AtomicU64::new(0);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..2u32)
            .map(|w| {
                let client = &client;
                s.spawn(move || {
                    for i in 0..3_000u32 {
                        client.put(format!("w{w}-{i}").as_bytes(), b"x").unwrap();
                        if i % 4 == 0 {
                            client.put(format!("w{w}-{}", i / 2).as_bytes(), b"y").unwrap();
                            client.delete(format!("w{w}-{}", i / 3).as_bytes()).unwrap();
                        }
                    }
                })
            })
            .collect();
        let scanner = {
            let (client, stable, stop, walks) = (&client, &stable, &stop, &walks);
            s.spawn(move || {
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let count = [3, 50, 2_000][n % 3];
                    let got: HashSet<Vec<u8>> = scan_all(client, count).into_iter().collect();
                    let missed: Vec<_> = stable.difference(&got).collect();
                    assert!(missed.is_empty(), "walk {n} (COUNT {count}) missed {} stable keys", missed.len());
                    walks.fetch_add(1, Ordering::Relaxed);
                    n += 1;
                }
            })
        };
        for w in writers {
            w.join().unwrap();
        }
        let seen = walks.load(Ordering::Relaxed);
        while walks.load(Ordering::Relaxed) < seen + 1 && !scanner.is_finished() {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
    });
    let grown = memnodes.iter().zip(&depths).filter(|(m, &d)| m.stats().global_depth > d).count();
    assert_eq!(grown, 3, "every memnode's table should have split during the walks");
    assert!(walks.load(Ordering::Relaxed) >= 2);

    // Quiet again: the walk, DBSIZE and the memnodes agree.
    let keys: HashSet<Vec<u8>> = scan_all(&client, 500).into_iter().collect();
    assert_eq!(client.len().unwrap(), keys.len() as u64, "DBSIZE and a quiet walk disagree");
    let picked: HashSet<Vec<u8>> = (0..50).map(|_| client.random_key().unwrap().expect("keys exist")).collect();
    assert!(picked.is_subset(&keys) && picked.len() > 10, "{} distinct random keys", picked.len());
    assert_eq!(client.delete_all().unwrap(), keys.len() as u64);
    assert_eq!(client.len().unwrap(), 0);
    assert!(scan_all(&client, 100).is_empty());
    assert_eq!(client.random_key().unwrap(), None);
}
