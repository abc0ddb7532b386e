//! Walks over the real table (`TableClient::scan`, `delete_all`, `random_key`) on every
//! transport: Redis' SCAN guarantee while other threads insert, delete and split, page
//! limits, emptying the table and picking random keys; and deterministic replays of the two
//! races a step's check of bucket 0 is for.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Hook, TornReads};
use racekv_hashing::hash::KeyHash;
use racekv_hashing::rpc::SplitRequest;

use racekv_hashing::scan::{SCAN_CHUNK_BUCKETS, SCAN_KEY_OVERHEAD_BYTES};
use racekv_hashing::testing::{scan, TestMemnode, Via};
use racekv_hashing::{ScanLimits, Table, TableClient, TableCursor, TableOptions};
use racekv_transport::Connection;
use racekv_transport::TransportKind;

const MIB: u64 = 1 << 20;

fn options() -> TableOptions {
    TableOptions { grace_period: Duration::from_millis(2), op_timeout: Duration::from_secs(30) }
}

/// Every key of one whole walk, in the order returned, with the pages' sizes.
fn walk(c: &mut TableClient, limits: ScanLimits) -> (Vec<Vec<u8>>, Vec<usize>) {
    let (mut keys, mut pages) = (Vec::new(), Vec::new());
    let mut cursor = TableCursor::START;
    loop {
        let page = c.scan(cursor, limits).unwrap();
        pages.push(page.keys.len());
        keys.extend(page.keys);
        match page.next {
            Some(next) => cursor = next,
            None => return (keys, pages),
        }
    }
}

/// A quiet table: one walk returns every key exactly once, whatever the page size.
fn returns_every_key_once(via: Via) {
    let memnode = TestMemnode::start(via, 32 * MIB, 4);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let keys: HashSet<Vec<u8>> = (0..3_000u32).map(|i| format!("key-{i}").into_bytes()).collect();
    for k in &keys {
        c.put(k, b"v").unwrap();
    }
    assert!(memnode.stats().global_depth >= 4, "the table should have split: {:?}", memnode.stats());
    for count in [1usize, 7, 10, 100, 1_000, 100_000] {
        let (got, pages) = walk(&mut c, ScanLimits::new(count, 100_000, 1 << 20));
        let unique: HashSet<Vec<u8>> = got.iter().cloned().collect();
        assert_eq!(unique.len(), got.len(), "COUNT {count}: a quiet walk returned a key twice");
        assert_eq!(unique, keys, "COUNT {count}");
        // A page stops once it has COUNT keys; the last step adds at most one step's slots.
        let most = count + (SCAN_CHUNK_BUCKETS * 7) as usize;
        assert!(pages.iter().all(|&n| n < most), "COUNT {count}: pages {pages:?}");
    }
}

/// Pages respect their key and byte limits, and a key longer than the byte limit still
/// comes back on its own (the walk always moves).
fn pages_respect_their_limits(via: Via) {
    let memnode = TestMemnode::start(via, 32 * MIB, 4);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let mut keys = HashSet::new();
    for i in 0..600u32 {
        let key = format!("{i:0>width$}", width = 10 + (i as usize % 50)).into_bytes();
        c.put(&key, b"").unwrap();
        keys.insert(key);
    }
    let long = vec![b'L'; 4_000];
    c.put(&long, b"v").unwrap();
    keys.insert(long.clone());
    let limits = ScanLimits::new(1_000, 13, 500);
    let mut cursor = TableCursor::START;
    let mut got = HashSet::new();
    loop {
        let page = c.scan(cursor, limits).unwrap();
        assert!(page.keys.len() <= 13, "{} keys in a page of at most 13", page.keys.len());
        let bytes: usize = page.keys.iter().map(|k| k.len() + SCAN_KEY_OVERHEAD_BYTES).sum();
        assert!(bytes <= 500 || page.keys.len() == 1, "{bytes} bytes in a page of at most 500");
        got.extend(page.keys);
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    assert_eq!(got, keys);
}

/// The guarantee under load: stable keys are never touched; other threads insert fresh keys
/// (forcing splits: subtables hold 84 slots) and delete them again; every walk, with pages
/// of any size, returns every stable key.
fn returns_stable_keys_while_others_write_and_split(via: Via) {
    let memnode = TestMemnode::start(via, 256 * MIB, 4);
    let table = memnode.table(options());
    let stable: Vec<Vec<u8>> = (0..400).map(|i| format!("stable-{i}").into_bytes()).collect();
    let mut c = table.client(memnode.connect());
    for k in &stable {
        c.put(k, k).unwrap();
    }
    let depth_before = memnode.stats().global_depth;
    let stop = AtomicBool::new(false);
    let walks = AtomicU64::new(0);
    let per_writer = if matches!(via, Via::Local) { 20_000u32 } else { 5_000 };
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..2u32)
            .map(|w| {
                let (table, memnode) = (&table, &memnode);
                s.spawn(move || {
                    let mut c = table.client(memnode.connect());
                    for i in 0..per_writer {
                        c.put(format!("fresh-{w}-{i}").as_bytes(), b"x").unwrap();
                        if i % 3 == 0 {
                            // Deletes, and updates of keys other than the stable ones.
                            c.delete(format!("fresh-{w}-{}", i / 2).as_bytes()).unwrap();
                            c.put(format!("fresh-{w}-{}", i / 3).as_bytes(), b"yy").unwrap();
                        }
                    }
                })
            })
            .collect();
        let readers: Vec<_> = (0..2usize)
            .map(|r| {
                let (table, memnode, stop, walks, stable) = (&table, &memnode, &stop, &walks, &stable);
                s.spawn(move || {
                    let mut c = table.client(memnode.connect());
                    let mut n = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        let count = [1, 10, 100, 5_000][(n + r) % 4];
                        let (got, _) = walk(&mut c, ScanLimits::new(count, 100_000, 1 << 20));
                        let got: HashSet<Vec<u8>> = got.into_iter().collect();
                        for k in stable {
                            assert!(got.contains(k), "walk {n} (COUNT {count}) missed {}", String::from_utf8_lossy(k));
                        }
                        walks.fetch_add(1, Ordering::Relaxed);
                        n += 1;
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        // A few more walks from start to end after the writers are done (unless a reader
        // failed: its panic is reported by the scope).
        let seen = walks.load(Ordering::Relaxed);
        while walks.load(Ordering::Relaxed) < seen + 2 && !readers.iter().any(|r| r.is_finished()) {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
    });
    let depth_after = memnode.stats().global_depth;
    assert!(
        depth_after >= depth_before + 3,
        "the writers should have split the table ({depth_before} -> {depth_after})"
    );
    assert!(walks.load(Ordering::Relaxed) >= 4, "too few walks to mean anything");
}

/// `delete_all` empties the table (count included); with a writer adding fresh keys
/// meanwhile, every key that was there before and not written again is gone.
fn delete_all_empties_the_table(via: Via) {
    let memnode = TestMemnode::start(via, 64 * MIB, 4);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    for i in 0..2_000u32 {
        c.put(format!("old-{i}").as_bytes(), b"v").unwrap();
    }
    c.flush().unwrap();
    assert_eq!(memnode.stats().items, 2_000);
    let done = AtomicBool::new(false);
    let written = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut w = table.client(memnode.connect());
            let mut n = 0u32;
            while !done.load(Ordering::Relaxed) && n < 20_000 {
                w.put(format!("new-{n}").as_bytes(), b"n").unwrap();
                n += 1;
            }
            w.flush().unwrap();
            n
        });
        let removed = c.delete_all().unwrap();
        assert!(removed >= 2_000, "removed {removed}");
        done.store(true, Ordering::Relaxed);
        writer.join().unwrap()
    });
    let items = scan(&*memnode.connect(), &memnode.layout());
    assert!(items.iter().all(|i| i.key.starts_with(b"new-")), "an old key survived delete_all");
    assert!(items.len() <= written as usize);
    c.flush().unwrap();
    assert_eq!(memnode.stats().items, items.len() as u64, "the item count follows what delete_all removed");
    // And a quiet one leaves nothing at all.
    c.delete_all().unwrap();
    assert!(scan(&*memnode.connect(), &memnode.layout()).is_empty());
    assert_eq!(memnode.stats().items, 0);
    assert_eq!(c.random_key(7).unwrap(), None);
}

/// `random_key`: None for an empty table, the only key of a table of one, and keys from
/// all over a larger table; `random_keys` (eviction's samples): distinct keys, at most as
/// many as asked for.
fn random_keys(via: Via) {
    let memnode = TestMemnode::start(via, 32 * MIB, 4);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    assert_eq!(c.random_key(1).unwrap(), None);
    assert!(c.random_keys(1, 5).unwrap().is_empty());
    c.put(b"only", b"v").unwrap();
    for seed in [0u64, 1, u64::MAX, 0xDEAD_BEEF_1234_5678] {
        assert_eq!(c.random_key(seed).unwrap().as_deref(), Some(&b"only"[..]), "seed {seed:#x}");
    }
    for i in 0..2_000u32 {
        c.put(format!("key-{i}").as_bytes(), b"v").unwrap();
    }
    let mut seen: HashMap<Vec<u8>, u32> = HashMap::new();
    for seed in 0..200u64 {
        let key = c.random_key(xxhash_seed(seed)).unwrap().expect("the table has keys");
        assert!(key == b"only" || key.starts_with(b"key-"));
        *seen.entry(key).or_default() += 1;
    }
    assert!(seen.len() > 100, "200 picks found only {} distinct keys", seen.len());
    for seed in 0..20u64 {
        let sample = c.random_keys(xxhash_seed(seed), 5).unwrap();
        let distinct: std::collections::HashSet<_> = sample.iter().collect();
        // One scan step's keys: a sparse stretch may hold fewer.
        assert!((1..=5).contains(&sample.len()) && distinct.len() == sample.len(), "seed {seed}: {sample:?}");
    }
}

fn xxhash_seed(n: u64) -> u64 {
    // Spread small numbers over all 64 bits, as a caller's random seed would be.
    n.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) ^ n
}

/// A table of one subtable (`groups` groups), holding `keys` keys, not split yet.
fn one_subtable(groups: u32, keys: u32) -> (TestMemnode, u64, Vec<Vec<u8>>) {
    let memnode = TestMemnode::start(Via::Local, 32 * MIB, groups);
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let names: Vec<Vec<u8>> = (0..keys).map(|i| format!("k{i}").into_bytes()).collect();
    for k in &names {
        c.put(k, b"v").unwrap();
    }
    c.flush().unwrap();
    assert_eq!(table.directory().global_depth(), 0, "no split yet");
    let subtable = table.directory().lookup(0).entry.subtable;
    (memnode, subtable, names)
}

/// A walk whose first step that makes no progress (a split in progress) runs `unstick` once
/// (finishing the split, as the memnode would).
fn walk_finishing_splits(c: &mut TableClient, limits: ScanLimits, unstick: impl FnOnce()) -> HashSet<Vec<u8>> {
    let mut unstick = Some(unstick);
    let mut got = HashSet::new();
    let mut cursor = TableCursor::START;
    for _ in 0..100_000 {
        let page = c.scan(cursor, limits).unwrap();
        let stuck = page.keys.is_empty() && page.next == Some(cursor);
        got.extend(page.keys);
        match page.next {
            None => return got,
            Some(next) => cursor = next,
        }
        if stuck {
            if let Some(f) = unstick.take() {
                f();
            }
        }
    }
    panic!("the walk did not end");
}

/// A split claims a subtable's buckets in rounds of 16, moving keys out of each round's
/// buckets before it claims the next. A walk in small steps that reaches the unclaimed
/// buckets meanwhile sees headers at the old depth there: were it to finish the subtable at
/// that depth, it would jump past the new half, where the first rounds moved keys. Bucket
/// 0's header, claimed first, tells it to wait.
#[test]
fn a_split_in_progress_does_not_end_the_subtable_early() {
    // 16 groups: 48 buckets, three rounds of the split.
    let (memnode, subtable, keys) = one_subtable(16, 250);
    let splitter = memnode.local_splitter();
    let hash = KeyHash::of(&keys[0], 16);
    let request = SplitRequest { dir_hash: hash.dir, observed_depth: 0, observed_subtable: subtable };
    // Round one moves the keys of buckets 0..16 whose hash has bit 0 set; the rest wait.
    splitter.split_then_crash(&request, 1).unwrap();
    let table = memnode.table(options());
    let mut c = table.client(memnode.connect());
    let got = walk_finishing_splits(&mut c, ScanLimits::new(1, 100, 1 << 20), || {
        assert!(splitter.recover().unwrap());
    });
    for k in &keys {
        assert!(got.contains(k), "{} was never returned", String::from_utf8_lossy(k));
    }
}

/// A run's READ is not atomic: a split can claim the run's buckets and move keys out of
/// them after the READ passed their headers and before it reaches their slots. The headers
/// it read agree with each other; bucket 0's, read again after the run, does not.
#[test]
fn a_split_inside_a_runs_read_does_not_hide_keys() {
    // 4 groups: 12 buckets, one round of the split, one run of the walk.
    let (memnode, subtable, _) = one_subtable(4, 40);
    let layout = memnode.layout();
    // A key that moves (bit 0 set) and sits in the last bucket: the tear after that bucket's
    // header leaves every header of the run read before the split.
    let items = scan(&*memnode.connect(), &layout);
    let last_bucket = subtable + (layout.buckets_per_subtable() - 1) * 64;
    let victim = items
        .iter()
        .find(|it| it.slot & !63 == last_bucket && KeyHash::of(&it.key, 4).dir & 1 == 1)
        .expect("a key that moves in the last bucket among 40");
    let splitter = Arc::new(memnode.local_splitter());
    let request =
        SplitRequest { dir_hash: KeyHash::of(&victim.key, 4).dir, observed_depth: 0, observed_subtable: subtable };
    let (in_tear, finisher) = (Arc::clone(&splitter), Arc::clone(&splitter));
    let hook: Hook = Box::new(move || {
        in_tear.split_then_crash(&request, 1).unwrap();
    });
    let torn: Arc<dyn Connection> =
        Arc::new(TornReads { inner: memnode.connect(), split_at: last_bucket + 8, hook: Mutex::new(Some(hook)) });
    let table = Table::open(Arc::clone(&torn), options()).unwrap();
    let mut c = table.client(torn);
    let got = walk_finishing_splits(&mut c, ScanLimits::new(1_000, 1_000, 1 << 20), || {
        assert!(finisher.recover().unwrap());
    });
    assert!(
        got.contains(&victim.key),
        "{} moved by a split inside the run's READ was never returned",
        String::from_utf8_lossy(&victim.key)
    );
    let all: HashSet<Vec<u8>> = items.into_iter().map(|i| i.key).collect();
    assert_eq!(got, all);
}

macro_rules! scan_suite {
    ($via:expr) => {
        #[test]
        fn returns_every_key_once() {
            super::returns_every_key_once($via);
        }
        #[test]
        fn pages_respect_their_limits() {
            super::pages_respect_their_limits($via);
        }
        #[test]
        fn returns_stable_keys_while_others_write_and_split() {
            super::returns_stable_keys_while_others_write_and_split($via);
        }
        #[test]
        fn delete_all_empties_the_table() {
            super::delete_all_empties_the_table($via);
        }
        #[test]
        fn random_keys() {
            super::random_keys($via);
        }
    };
}

mod local {
    scan_suite!(racekv_hashing::testing::Via::Local);
}

mod shm {
    scan_suite!(racekv_hashing::testing::Via::Transport(super::TransportKind::Shm));
}

mod tcp {
    scan_suite!(racekv_hashing::testing::Via::Transport(super::TransportKind::Tcp));
}

#[cfg(feature = "rdma")]
mod verbs {
    scan_suite!(racekv_hashing::testing::Via::Transport(super::TransportKind::Verbs));
}
