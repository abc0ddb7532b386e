//! Values too large for a block, over the real table: they live in extents the memnode
//! allocates (`extents.rs`), behind indirect blocks swung by one CAS like any other.
//! Byte-exact round trips across transports and sizes (past one transport operation's
//! 16 MiB), every way a value is replaced or removed giving its extent back, a restart
//! finding live extents again, and readers racing writers that never see a torn value.
//! Keys too long for a block, in extents of their own: the same, and found by scans and
//! moved by splits without reading them.
//!
//! Not built with `rdma`: that build runs in the emulated Soft-RoCE VM for the verbs suites,
//! and these have no verbs case (moving hundreds of MiB under emulation only costs time).
#![cfg(not(feature = "rdma"))]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use racekv_hashing::clock::now_unix_ms;
use racekv_hashing::expiry::ExpiryOptions;
use racekv_hashing::layout::{MAX_INLINE_KEY_BYTES, MAX_KEY_BYTES, MAX_KV_BYTES};
use racekv_hashing::scan::{ScanLimits, TableCursor};
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_hashing::{Error, Expiry, PutOptions, PutOutcome, TableOptions};
use racekv_transport::TransportKind;

const MIB: u64 = 1 << 20;

fn options() -> TableOptions {
    TableOptions { grace_period: Duration::from_millis(1), op_timeout: Duration::from_secs(60) }
}

/// A value of `len` bytes that differs with `seed` everywhere (so a mix of two is caught).
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).rotate_left(u32::from(seed % 7))).collect()
}

/// Waits until the memnode gave every retired extent back (the grace period is 100 ms).
fn extents_settle(memnode: &TestMemnode) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let extents = memnode.extents();
    while extents.pending_bytes() > 0 {
        assert!(Instant::now() < deadline, "retired extents were never released");
        std::thread::sleep(Duration::from_millis(20));
        extents.release().unwrap();
    }
}

fn round_trips(via: Via, sizes: &[usize]) {
    let memnode = TestMemnode::start(via, 256 * MIB, 16);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    for (i, &len) in sizes.iter().enumerate() {
        let key = format!("big:{len}");
        let value = pattern(len, i as u8);
        assert_eq!(c.put(key.as_bytes(), &value).unwrap(), PutOutcome::Inserted, "{len} B");
        let got = c.get(key.as_bytes()).unwrap().expect("present");
        assert!(got == value, "{len} B came back different ({} B)", got.len());
    }
    // get_many finds large values among small ones (by the single-key way).
    c.put(b"small", b"s").unwrap();
    let keys: Vec<Vec<u8>> = sizes.iter().map(|len| format!("big:{len}").into_bytes()).collect();
    let mut wanted: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    wanted.push(b"small");
    wanted.push(b"absent");
    let got = c.get_many(&wanted).unwrap();
    for (i, &len) in sizes.iter().enumerate() {
        assert_eq!(got[i].as_ref().map(Vec::len), Some(len));
        assert!(got[i].as_deref() == Some(&pattern(len, i as u8)[..]));
    }
    assert_eq!(got[sizes.len()].as_deref(), Some(&b"s"[..]));
    assert_eq!(got[sizes.len() + 1], None);
    let live: u64 = sizes.iter().filter(|&&l| l + 16 > MAX_KV_BYTES).map(|&l| (l as u64).div_ceil(64) * 64).sum();
    assert_eq!(memnode.extents().live_bytes(), live, "one extent per large value");
}

#[test]
fn values_of_every_size_round_trip_local() {
    round_trips(Via::Local, &[0, 1, MAX_KV_BYTES - 20, MAX_KV_BYTES, 17_000, 1 << 20, (16 << 20) + 12_345]);
}

#[test]
fn values_of_every_size_round_trip_tcp() {
    round_trips(Via::Transport(TransportKind::Tcp), &[17_000, 1 << 20, (16 << 20) + 12_345, 40 << 20]);
}

#[test]
fn values_of_every_size_round_trip_shm() {
    round_trips(Via::Transport(TransportKind::Shm), &[17_000, 3 << 20]);
}

/// Overwrites (large over large, small over large, large over small), deletes, CAS and
/// expiry: each gives its extent back, and a steady overwrite keeps the heap bounded.
fn every_removal_gives_the_extent_back(via: Via) {
    let memnode = TestMemnode::start(via, 128 * MIB, 16);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let extents = memnode.extents();
    let one = pattern(MIB as usize, 1);
    c.put(b"k", &one).unwrap();
    assert_eq!(extents.live_bytes(), MIB);
    for round in 0..40u8 {
        c.put(b"k", &pattern(MIB as usize, round)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(extents.live_bytes(), MIB, "only the current value's extent is live");
    extents_settle(&memnode);
    let used = memnode.kv_heap_used_bytes();
    assert!(used < 16 * MIB, "40 overwrites of 1 MiB left {used} B in use: extents were not reused");

    c.put(b"k", b"small now").unwrap();
    assert_eq!(extents.live_bytes(), 0, "small over large");
    c.put(b"k", &one).unwrap();
    assert!(c.delete(b"k").unwrap());
    assert_eq!(extents.live_bytes(), 0, "delete");

    // Compare-and-swap against a large value, and SET ... GET of one.
    c.put(b"cas", &one).unwrap();
    let two = pattern(2 * MIB as usize, 2);
    assert!(!c.compare_and_swap(b"cas", Some(&two), Some(b"x")).unwrap());
    assert!(c.compare_and_swap(b"cas", Some(&one), Some(&two)).unwrap());
    let old = c.put_opts(b"cas", b"y", PutOptions { return_old: true, ..PutOptions::default() }).unwrap().old;
    assert!(old.as_deref() == Some(&two[..]), "the old large value comes back whole");
    assert_eq!(extents.live_bytes(), 0);

    // Lazy expiry (a read), and active expiry (the memnode's sweep).
    let past = now_unix_ms() - 1000;
    let expired = PutOptions { expiry: Expiry::At(past), ..PutOptions::default() };
    c.put_opts(b"lazy", &one, expired).unwrap();
    c.put_opts(b"active", &one, expired).unwrap();
    assert_eq!(extents.live_bytes(), 2 * MIB);
    assert_eq!(c.get(b"lazy").unwrap(), None);
    assert_eq!(extents.live_bytes(), MIB, "the read removed it and retired its extent");
    let mut sweep =
        memnode.active_expiry(ExpiryOptions { grace: Duration::from_millis(1), ..ExpiryOptions::default() });
    sweep.cycle().unwrap();
    assert_eq!(extents.live_bytes(), 0, "the sweep retired the last one");

    // FLUSHALL.
    for i in 0..5 {
        c.put(format!("f{i}").as_bytes(), &one).unwrap();
    }
    assert_eq!(c.delete_all().unwrap(), 6, "the five and \"cas\"");
    assert_eq!(extents.live_bytes(), 0, "delete_all");
    extents_settle(&memnode);
}

#[test]
fn every_removal_gives_the_extent_back_local() {
    every_removal_gives_the_extent_back(Via::Local);
}

#[test]
fn every_removal_gives_the_extent_back_tcp() {
    every_removal_gives_the_extent_back(Via::Transport(TransportKind::Tcp));
}

#[test]
fn limits_are_clear_errors() {
    let memnode = TestMemnode::start(Via::Local, 16 * MIB, 16);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let long_key = vec![b'k'; MAX_KEY_BYTES + 1];
    let e = c.put(&long_key, b"v").unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("keys take at most"), "{e}");
    assert!(matches!(c.get(&long_key).unwrap_err(), Error::TooLarge { .. }));
    assert!(matches!(c.put(b"", b"v").unwrap_err(), Error::EmptyKey));
    // Longer than the region holds: the memnode's clear out-of-memory, and nothing leaks.
    let e = c.put(b"huge", &vec![0u8; 32 * MIB as usize]).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert_eq!(memnode.extents().live_bytes(), 0);
    assert_eq!(c.get(b"huge").unwrap(), None);
    c.put(b"fits", &vec![1u8; 4 * MIB as usize]).unwrap();
    assert_eq!(c.get(b"fits").unwrap().map(|v| v.len()), Some(4 * MIB as usize));
}

#[test]
fn a_restart_finds_live_extents_and_frees_the_rest() {
    let memnode = TestMemnode::start(Via::Local, 64 * MIB, 16);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let keep = pattern(3 * MIB as usize, 3);
    c.put(b"keep", &keep).unwrap();
    c.put(b"gone", &pattern(2 * MIB as usize, 4)).unwrap();
    c.delete(b"gone").unwrap();
    extents_settle(&memnode);
    std::mem::forget(c); // a client that dies holding space
    let found = memnode.reclaim_as_if_restarted();
    assert_eq!(found.extents.len(), 1, "{found:?}");
    assert_eq!(found.extents[0].1, 3 * MIB);
    assert_eq!(found.bad_extents, 0);
    let mut c = table.client(memnode.connect());
    assert!(c.get(b"keep").unwrap().as_deref() == Some(&keep[..]), "the live extent survived the reclaim");
    // The reclaimed space is used again and the kept value is untouched by it.
    for i in 0..6u8 {
        c.put(format!("new{i}").as_bytes(), &pattern(4 * MIB as usize, i)).unwrap();
    }
    assert!(c.get(b"keep").unwrap().as_deref() == Some(&keep[..]));
    c.delete(b"keep").unwrap();
    assert_eq!(memnode.extents().live_bytes(), 6 * 4 * MIB);
}

/// Writers replace one key's large value with whole values of distinct patterns (and
/// sizes) while readers read it: every read is one whole written value, never a mix or a
/// piece, and the extents in use at the end are exactly the final value's.
fn readers_never_see_a_torn_value(via: Via) {
    let memnode = TestMemnode::start(via, 256 * MIB, 16);
    let table = memnode.table(TableOptions { grace_period: Duration::from_millis(1), ..options() });
    const WRITERS: u8 = 3;
    const VERSIONS: u8 = 24;
    let sizes = |seed: u8| 20_000 + (usize::from(seed) * 37_331) % (3 << 20);
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for w in 0..WRITERS {
        let mut c = table.client(memnode.connect());
        threads.push(std::thread::spawn(move || {
            for v in 0..VERSIONS {
                let seed = w * VERSIONS + v;
                c.put(b"contended", &pattern(sizes(seed), seed)).unwrap();
                if v % 3 == 0 {
                    c.put(format!("side{w}").as_bytes(), b"small between").unwrap();
                }
            }
            0
        }));
    }
    for _ in 0..3 {
        let mut c = table.client(memnode.connect());
        let stop = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || {
            let mut reads = 0;
            while !stop.load(Ordering::Relaxed) {
                if let Some(v) = c.get(b"contended").unwrap() {
                    let seed = (0..WRITERS * VERSIONS).find(|&s| sizes(s) == v.len()).expect("a written size");
                    assert!(v == pattern(v.len(), seed), "a torn or mixed value of {} B", v.len());
                    reads += 1;
                }
            }
            reads
        }));
    }
    let writers: Vec<_> = threads.drain(..usize::from(WRITERS)).collect();
    for t in writers {
        t.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let reads: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(reads > 0, "the readers read");
    let mut c = table.client(memnode.connect());
    let last = c.get(b"contended").unwrap().unwrap();
    assert_eq!(
        memnode.extents().live_bytes(),
        (last.len() as u64).div_ceil(64) * 64,
        "one live extent: the last value's"
    );
}

#[test]
fn readers_never_see_a_torn_value_local() {
    readers_never_see_a_torn_value(Via::Local);
}

#[test]
fn readers_never_see_a_torn_value_tcp() {
    readers_never_see_a_torn_value(Via::Transport(TransportKind::Tcp));
}

/// A key of `len` bytes, distinct per `seed` (and differing from another seed's only at its
/// end, so a comparison that stops early would confuse them).
fn long_key(len: usize, seed: u8) -> Vec<u8> {
    let mut key = vec![b'L'; len];
    key[len - 1] = seed;
    key
}

fn all_keys(c: &mut racekv_hashing::TableClient) -> Vec<Vec<u8>> {
    let (mut keys, mut cursor) = (Vec::new(), Some(TableCursor::START));
    while let Some(at) = cursor {
        let page = c.scan(at, ScanLimits::new(100, 1000, 64 << 20)).unwrap();
        keys.extend(page.keys);
        cursor = page.next;
    }
    keys.sort();
    keys.dedup();
    keys
}

fn long_keys_round_trip(via: Via) {
    let memnode = TestMemnode::start(via, 256 * MIB, 16);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let extents = memnode.extents();
    // (key length, value length): a long key fits a block with a tiny value; past it, or
    // past the inline limit, the key goes to an extent; up to a key past one READ (16 MiB).
    let cases = [
        (MAX_INLINE_KEY_BYTES, 3 * MIB as usize),
        (MAX_INLINE_KEY_BYTES + 1, 0),
        (MAX_KV_BYTES - 1, 1),
        (MAX_KV_BYTES, 0),
        (100_000, 5),
        (MIB as usize, 2 * MIB as usize),
        ((16 << 20) + 777, 1000),
    ];
    let mut want = Vec::new();
    for (i, &(key_len, value_len)) in cases.iter().enumerate() {
        let key = long_key(key_len, i as u8);
        let value = pattern(value_len, i as u8);
        assert_eq!(c.put(&key, &value).unwrap(), PutOutcome::Inserted, "key {key_len} B, value {value_len} B");
        assert!(c.get(&key).unwrap().as_deref() == Some(&value[..]), "key {key_len} B");
        // The same length, one byte different: another key.
        assert_eq!(c.get(&long_key(key_len, 200 + i as u8)).unwrap(), None, "key {key_len} B");
        want.push((key, value));
    }
    let refs: Vec<&[u8]> = want.iter().map(|(k, _)| &k[..]).collect();
    let got = c.get_many(&refs).unwrap();
    for ((key, value), got) in want.iter().zip(&got) {
        assert!(got.as_deref() == Some(&value[..]), "get_many of a {} B key", key.len());
    }
    let mut keys: Vec<Vec<u8>> = want.iter().map(|(k, _)| k.clone()).collect();
    keys.sort();
    assert!(all_keys(&mut c) == keys, "a scan returns every long key whole");
    let item = c.get_item(&want[5].0).unwrap().unwrap();
    assert!(item.value == want[5].1);

    // Overwrite small over large and back, CAS, delete: every extent comes back.
    let (key, value) = &want[5];
    assert_eq!(c.put(key, b"tiny").unwrap(), PutOutcome::Updated);
    assert_eq!(c.get(key).unwrap().as_deref(), Some(&b"tiny"[..]));
    assert!(c.compare_and_swap(key, Some(b"tiny"), Some(value)).unwrap());
    assert!(!c.compare_and_swap(key, Some(b"tiny"), None).unwrap());
    assert!(c.compare_and_swap(key, Some(value), None).unwrap());
    assert_eq!(c.get(key).unwrap(), None);
    assert!(!c.delete(key).unwrap());
    for (key, _) in &want {
        c.delete(key).unwrap();
    }
    assert_eq!(extents.live_bytes(), 0, "deletes retire key and value extents");
    assert!(all_keys(&mut c).is_empty());
    extents_settle(&memnode);
}

#[test]
fn long_keys_round_trip_local() {
    long_keys_round_trip(Via::Local);
}

#[test]
fn long_keys_round_trip_tcp() {
    long_keys_round_trip(Via::Transport(TransportKind::Tcp));
}

/// Enough long keys to split the table several times: splits place them by the digest
/// their blocks keep, and every one is still found, once, afterwards.
#[test]
fn splits_move_long_keys() {
    let memnode = TestMemnode::start(Via::Local, 256 * MIB, 4);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let depth_before = c.table_stats().unwrap().global_depth;
    let keys: Vec<Vec<u8>> = (0..600u32)
        .map(|i| {
            let mut key = format!("{i}:").into_bytes();
            key.resize(MAX_INLINE_KEY_BYTES + 1 + (i as usize % 500), b'.');
            key
        })
        .collect();
    for (i, key) in keys.iter().enumerate() {
        c.put(key, &pattern(i % 300, i as u8)).unwrap();
    }
    assert!(c.table_stats().unwrap().global_depth > depth_before, "the table split");
    for (i, key) in keys.iter().enumerate() {
        assert!(c.get(key).unwrap().as_deref() == Some(&pattern(i % 300, i as u8)[..]), "key {i}");
    }
    let mut sorted = keys.clone();
    sorted.sort();
    assert!(all_keys(&mut c) == sorted);
    let items = racekv_hashing::testing::scan(&*memnode.connect(), &memnode.layout());
    assert_eq!(items.len(), keys.len(), "one copy each");
    assert!(items.iter().all(|item| item.admitted), "every key in a bucket that admits it");
}

/// Expiry (lazy and active) and a restart's reclaim know key extents too.
#[test]
fn expiry_and_reclaim_handle_long_keys() {
    let memnode = TestMemnode::start(Via::Local, 128 * MIB, 16);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let extents = memnode.extents();
    let key_bytes = |len: usize| (len as u64).div_ceil(64) * 64;
    let expired = PutOptions { expiry: Expiry::At(now_unix_ms() - 1000), ..PutOptions::default() };
    let (lazy, active, kept) = (long_key(40_000, 1), long_key(50_000, 2), long_key(60_000, 3));
    c.put_opts(&lazy, b"v", expired).unwrap();
    c.put_opts(&active, b"v", expired).unwrap();
    c.put(&kept, b"kept").unwrap();
    assert_eq!(extents.live_bytes(), key_bytes(40_000) + key_bytes(50_000) + key_bytes(60_000) + 3 * 64);
    assert_eq!(c.get(&lazy).unwrap(), None);
    let mut sweep =
        memnode.active_expiry(ExpiryOptions { grace: Duration::from_millis(1), ..ExpiryOptions::default() });
    sweep.cycle().unwrap();
    assert_eq!(extents.live_bytes(), key_bytes(60_000) + 64, "only the kept item's two extents");
    extents_settle(&memnode);
    std::mem::forget(c);
    let found = memnode.reclaim_as_if_restarted();
    let mut sizes: Vec<u64> = found.extents.iter().map(|e| e.1).collect();
    sizes.sort();
    assert_eq!(sizes, vec![64, key_bytes(60_000)], "{found:?}");
    assert_eq!(found.bad_extents, 0);
    let mut c = table.client(memnode.connect());
    assert_eq!(c.get(&kept).unwrap().as_deref(), Some(&b"kept"[..]));
}
