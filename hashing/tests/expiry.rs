//! Expiry over the real table: items written with an expiry time, read, rewritten and
//! removed, lazily by readers and actively by the memnode's sampling.
//!
//! Times are absolute Unix milliseconds. Items "already expired" are written with a time
//! in the past; a test that needs an item to expire while it runs gives it a time a little
//! ahead and checks each read against the clock read before it started, never against how
//! long anything took.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use racekv_hashing::clock::{now_unix_ms, MAX_CLOCK_SKEW_MS};
use racekv_hashing::expiry::ExpiryOptions;
use racekv_hashing::testing::{scan, TestMemnode, Via};
use racekv_hashing::{Expiry, ExpiryUpdate, Item, PutMode, PutOptions, PutOutcome, TableOptions, MAX_KV_BYTES};
use racekv_transport::TransportKind;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const MIB: u64 = 1 << 20;
const HOUR_MS: u64 = 3_600_000;

fn options(grace_ms: u64) -> TableOptions {
    TableOptions { grace_period: Duration::from_millis(grace_ms), op_timeout: Duration::from_secs(30) }
}

fn at(expires_at_ms: u64, mode: PutMode) -> PutOptions {
    PutOptions { mode, expiry: Expiry::At(expires_at_ms), return_old: false }
}

fn copies_of(memnode: &TestMemnode, key: &[u8]) -> usize {
    scan(&*memnode.connect(), &memnode.layout()).iter().filter(|i| i.key == key).count()
}

fn every_operation_treats_expired_items_as_absent(via: Via) {
    let memnode = TestMemnode::start(via, 16 * MIB, 16);
    let table = memnode.table(options(1));
    let mut c = table.client(memnode.connect());
    let later = now_unix_ms() + HOUR_MS;
    let past = now_unix_ms() - 1000;

    // Reads.
    assert_eq!(c.put_opts(b"live", b"v", at(later, PutMode::Upsert)).unwrap().outcome, PutOutcome::Inserted);
    assert_eq!(c.get(b"live").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(c.get_item(b"live").unwrap(), Some(Item { value: b"v".to_vec(), expires_at_ms: Some(later) }));
    c.put_opts(b"gone", b"v", at(past, PutMode::Upsert)).unwrap();
    c.flush().unwrap();
    let items = memnode.stats().items;
    assert_eq!(copies_of(&memnode, b"gone"), 1, "written, though no reader sees it");
    assert_eq!(c.get(b"gone").unwrap(), None);
    assert_eq!(c.stats().expired_removed, 1, "the read removed it");
    assert_eq!(copies_of(&memnode, b"gone"), 0);
    c.flush().unwrap();
    assert_eq!(memnode.stats().items, items - 1, "and counted it out");
    c.put_opts(b"gone", b"v", at(past, PutMode::Upsert)).unwrap();
    assert_eq!(c.get_item(b"gone").unwrap(), None);

    // A plain put clears the expiry; Keep keeps it; a new key kept gets none.
    c.put_opts(b"k", b"1", at(later, PutMode::Upsert)).unwrap();
    let keep = PutOptions { expiry: Expiry::Keep, ..PutOptions::default() };
    c.put_opts(b"k", b"2", keep).unwrap();
    assert_eq!(c.get_item(b"k").unwrap(), Some(Item { value: b"2".to_vec(), expires_at_ms: Some(later) }));
    c.put(b"k", b"3").unwrap();
    assert_eq!(c.get_item(b"k").unwrap(), Some(Item { value: b"3".to_vec(), expires_at_ms: None }));
    c.put_opts(b"new-kept", b"x", keep).unwrap();
    assert_eq!(c.get_item(b"new-kept").unwrap().unwrap().expires_at_ms, None);
    c.put_opts(b"expired-kept", b"x", at(past, PutMode::Upsert)).unwrap();
    assert_eq!(c.put_opts(b"expired-kept", b"y", keep).unwrap().outcome, PutOutcome::Inserted);
    assert_eq!(c.get_item(b"expired-kept").unwrap(), Some(Item { value: b"y".to_vec(), expires_at_ms: None }));
    assert_eq!(copies_of(&memnode, b"expired-kept"), 1);

    // Conditions: an expired key is absent to NX and XX, and its slot is reused.
    c.put_opts(b"nx", b"old", at(past, PutMode::Upsert)).unwrap();
    assert_eq!(c.put_with(b"nx", b"new", PutMode::UpdateOnly).unwrap(), PutOutcome::NotApplied);
    assert_eq!(c.put_with(b"nx", b"new", PutMode::InsertOnly).unwrap(), PutOutcome::Inserted);
    assert_eq!(c.get(b"nx").unwrap().as_deref(), Some(&b"new"[..]));
    assert_eq!(copies_of(&memnode, b"nx"), 1, "the insert replaced the expired copy, not joined it");
    assert_eq!(c.put_with(b"nx", b"newer", PutMode::InsertOnly).unwrap(), PutOutcome::NotApplied);

    // The old value, for SET ... GET: only a live one, whether or not the put applies.
    let get_old = |mode| PutOptions { mode, expiry: Expiry::Never, return_old: true };
    let r = c.put_opts(b"nx", b"x", get_old(PutMode::InsertOnly)).unwrap();
    assert_eq!((r.outcome, r.old.as_deref()), (PutOutcome::NotApplied, Some(&b"new"[..])));
    let r = c.put_opts(b"nx", b"x", get_old(PutMode::Upsert)).unwrap();
    assert_eq!((r.outcome, r.old.as_deref()), (PutOutcome::Updated, Some(&b"new"[..])));
    c.put_opts(b"old-gone", b"secret", at(past, PutMode::Upsert)).unwrap();
    let r = c.put_opts(b"old-gone", b"x", get_old(PutMode::Upsert)).unwrap();
    assert_eq!((r.outcome, r.old), (PutOutcome::Inserted, None));
    let r = c.put_opts(b"absent-old", b"x", get_old(PutMode::UpdateOnly)).unwrap();
    assert_eq!((r.outcome, r.old), (PutOutcome::NotApplied, None));

    // Delete: an expired key was not there, and is removed.
    c.put_opts(b"del", b"v", at(past, PutMode::Upsert)).unwrap();
    assert!(!c.delete(b"del").unwrap());
    assert_eq!(copies_of(&memnode, b"del"), 0);

    // Compare-and-swap keeps the expiry, and sees an expired key as absent.
    c.put_opts(b"counter", b"1", at(later, PutMode::Upsert)).unwrap();
    assert!(c.compare_and_swap(b"counter", Some(b"1"), Some(b"2")).unwrap());
    assert_eq!(c.get_item(b"counter").unwrap(), Some(Item { value: b"2".to_vec(), expires_at_ms: Some(later) }));
    c.put_opts(b"cas-gone", b"1", at(past, PutMode::Upsert)).unwrap();
    assert!(!c.compare_and_swap(b"cas-gone", Some(b"1"), Some(b"2")).unwrap());
    assert!(c.compare_and_swap(b"cas-gone", None, Some(b"fresh")).unwrap());
    assert_eq!(c.get_item(b"cas-gone").unwrap(), Some(Item { value: b"fresh".to_vec(), expires_at_ms: None }));
    assert_eq!(copies_of(&memnode, b"cas-gone"), 1);

    // Expiry updates.
    c.put(b"e", b"v").unwrap();
    let (item, changed) = c
        .update_expiry(b"e", |cur| {
            assert_eq!(cur, None);
            ExpiryUpdate::Set(Some(later))
        })
        .unwrap()
        .unwrap();
    assert_eq!((item.expires_at_ms, changed), (None, true));
    assert_eq!(c.get_item(b"e").unwrap().unwrap().expires_at_ms, Some(later));
    let (item, changed) = c.update_expiry(b"e", |_| ExpiryUpdate::Unchanged).unwrap().unwrap();
    assert_eq!((item.value.as_slice(), item.expires_at_ms, changed), (&b"v"[..], Some(later), false));
    let (_, changed) = c.update_expiry(b"e", |_| ExpiryUpdate::Set(Some(later))).unwrap().unwrap();
    assert!(changed, "the same time again counts as set");
    c.update_expiry(b"e", |_| ExpiryUpdate::Set(None)).unwrap().unwrap();
    assert_eq!(c.get_item(b"e").unwrap(), Some(Item { value: b"v".to_vec(), expires_at_ms: None }));
    c.update_expiry(b"e", |_| ExpiryUpdate::Delete).unwrap().unwrap();
    assert_eq!(c.get(b"e").unwrap(), None);
    assert_eq!(copies_of(&memnode, b"e"), 0);
    let decided = AtomicBool::new(false);
    let absent = c.update_expiry(b"e", |_| {
        decided.store(true, Ordering::Relaxed);
        ExpiryUpdate::Delete
    });
    assert_eq!(absent.unwrap(), None);
    assert!(!decided.load(Ordering::Relaxed), "nothing to decide for an absent key");
    c.put_opts(b"e-gone", b"v", at(past, PutMode::Upsert)).unwrap();
    assert_eq!(c.update_expiry(b"e-gone", |_| ExpiryUpdate::Set(None)).unwrap(), None, "no reviving");

    // Many keys at once: expired ones are absent, and removed.
    let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("m{i}").into_bytes()).collect();
    for (i, key) in keys.iter().enumerate() {
        let when = if i % 3 == 0 { past } else { later };
        if i % 5 != 4 {
            c.put_opts(key, key, at(when, PutMode::Upsert)).unwrap();
        }
    }
    let expected: Vec<Option<Vec<u8>>> =
        keys.iter().enumerate().map(|(i, k)| (i % 3 != 0 && i % 5 != 4).then(|| k.clone())).collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let before = c.stats().expired_removed;
    assert_eq!(c.get_many(&refs).unwrap(), expected);
    assert!(c.stats().expired_removed - before >= 10, "{:?}", c.stats());
    assert_eq!(c.get_many_in_order(&refs).unwrap(), expected);
    let left = scan(&*memnode.connect(), &memnode.layout());
    assert!(left.iter().all(|i| !i.key.starts_with(b"m") || i.expires_at_ms == Some(later)), "expired items left");

    // Sizes: an expiry takes 8 bytes of the block; a value that then no longer fits one
    // goes to an extent, expiry and all (and back into a block when it fits again).
    let big = vec![7u8; MAX_KV_BYTES - 3];
    c.put(b"big", &big).unwrap();
    c.put_opts(b"big", &big, at(later, PutMode::Upsert)).unwrap();
    assert_eq!(c.get_item(b"big").unwrap(), Some(Item { value: big.clone(), expires_at_ms: Some(later) }));
    let fits = vec![7u8; MAX_KV_BYTES - 3 - 8];
    c.put_opts(b"big", &fits, keep).unwrap();
    assert_eq!(c.get_item(b"big").unwrap(), Some(Item { value: fits, expires_at_ms: Some(later) }));
    c.put_opts(b"big", &big, keep).unwrap();
    assert_eq!(c.get_item(b"big").unwrap(), Some(Item { value: big, expires_at_ms: Some(later) }));
    // A key too long for a block (in an extent of its own) keeps its expiry in the block.
    let long_key = vec![b'k'; MAX_KV_BYTES];
    c.put_opts(&long_key, b"v", at(later, PutMode::Upsert)).unwrap();
    assert_eq!(c.get_item(&long_key).unwrap(), Some(Item { value: b"v".to_vec(), expires_at_ms: Some(later) }));
}

#[test]
fn every_operation_treats_expired_items_as_absent_local() {
    every_operation_treats_expired_items_as_absent(Via::Local);
}

#[test]
fn every_operation_treats_expired_items_as_absent_tcp() {
    every_operation_treats_expired_items_as_absent(Via::Transport(TransportKind::Tcp));
}

#[test]
fn every_operation_treats_expired_items_as_absent_shm() {
    every_operation_treats_expired_items_as_absent(Via::Transport(TransportKind::Shm));
}

/// An item written to expire a little later is returned by no read that starts after its
/// expiry (by the reader's clock, which is the writer's here: the slack is zero).
#[test]
fn no_read_after_the_expiry_returns_the_item() {
    let memnode = TestMemnode::start(Via::Local, 16 * MIB, 16);
    let table = memnode.table(options(1));
    let mut c = table.client(memnode.connect());
    let keys: Vec<Vec<u8>> = (0..16).map(|i| format!("soon{i}").into_bytes()).collect();
    let expires_at = now_unix_ms() + 200;
    for key in &keys {
        c.put_opts(key, key, at(expires_at, PutMode::Upsert)).unwrap();
    }
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let (mut seen_before, mut absent_after) = (0u64, 0u64);
    loop {
        let started = now_unix_ms();
        let one = c.get(&keys[0]).unwrap();
        let many = c.get_many(&refs).unwrap();
        if started > expires_at {
            assert_eq!(one, None, "read at {started} ms, expired at {expires_at} ms");
            assert!(many.iter().all(Option::is_none), "read at {started} ms, expired at {expires_at} ms");
            absent_after += 1;
            if absent_after == 3 {
                break;
            }
        } else if one.is_some() {
            seen_before += 1;
        }
    }
    assert!(seen_before > 0, "the items were never seen live: the test proved little");
}

/// Keys that expire unread come back as free heap through the memnode's sampling, and new
/// keys use that heap instead of growing it; keys without an expiry are left alone.
fn keys_expiring_unread_come_back_as_free_heap(via: Via) {
    let memnode = TestMemnode::start(via, 64 * MIB, 64);
    const EXPIRING: u64 = 3000;
    const KEPT: u64 = 500;
    let value = vec![5u8; 200];
    let past = now_unix_ms() - MAX_CLOCK_SKEW_MS - 1000;
    {
        let table = memnode.table(options(1));
        let mut c = table.client(memnode.connect());
        for i in 0..EXPIRING {
            c.put_opts(format!("exp{i:06}").as_bytes(), &value, at(past, PutMode::Upsert)).unwrap();
        }
        for i in 0..KEPT {
            c.put(format!("kept{i:05}").as_bytes(), &value).unwrap();
        }
        c.flush().unwrap();
    }
    assert_eq!(memnode.stats().items, EXPIRING + KEPT);
    let used_before = memnode.kv_heap_used_bytes();
    let block_bytes = racekv_hashing::layout::block_units_for(9, value.len(), true).unwrap() as u64 * 64;

    let grace = Duration::from_millis(1);
    let mut expiry = memnode.active_expiry(ExpiryOptions { grace, ..ExpiryOptions::default() });
    let mut removed = 0;
    let mut rounds = 0u64;
    while removed < EXPIRING {
        let round = expiry.sample_round(now_unix_ms()).unwrap();
        assert_eq!(round.expired, round.with_expiry, "every item with an expiry here has expired");
        removed += round.removed;
        rounds += 1;
        assert!(rounds < 1_000_000, "sampling found {removed} of {EXPIRING} expired items");
    }
    std::thread::sleep(grace);
    let freed = expiry.release_due(std::time::Instant::now()).unwrap();
    assert_eq!(freed, EXPIRING * block_bytes, "every removed block went back to the heap");
    assert_eq!(expiry.pending_bytes(), 0);
    assert_eq!(memnode.stats().items, KEPT, "the item count follows the removals");
    assert_eq!(memnode.kv_heap_used_bytes(), used_before - EXPIRING * block_bytes);

    // A new process writes as many keys of the same size: into the freed heap.
    let top = |m: &TestMemnode| {
        let heap = m.stats().heap;
        heap.heap_used_bytes + heap.heap_free_bytes - heap.subtables * m.layout().subtable_bytes()
    };
    let top_before = top(&memnode);
    {
        let table = memnode.table(options(1));
        let mut c = table.client(memnode.connect());
        for i in 0..EXPIRING {
            c.put(format!("new{i:06}").as_bytes(), &value).unwrap();
        }
        for i in 0..KEPT {
            assert_eq!(c.get(format!("kept{i:05}").as_bytes()).unwrap().as_deref(), Some(&value[..]), "kept{i}");
        }
        c.flush().unwrap();
    }
    assert_eq!(top(&memnode), top_before, "the new keys grew the heap instead of using the freed blocks");
    assert_eq!(memnode.stats().items, EXPIRING + KEPT);
}

#[test]
fn keys_expiring_unread_come_back_as_free_heap_local() {
    keys_expiring_unread_come_back_as_free_heap(Via::Local);
}

#[test]
fn keys_expiring_unread_come_back_as_free_heap_tcp() {
    keys_expiring_unread_come_back_as_free_heap(Via::Transport(TransportKind::Tcp));
}

/// However often the memnode's thread wakes to give blocks back, cycles (and their time
/// budgets) are at least the interval apart: the share of a core they take stays bounded.
#[test]
fn cycles_are_at_least_the_interval_apart() {
    let memnode = TestMemnode::start(Via::Local, 16 * MIB, 16);
    let table = memnode.table(options(1));
    let mut c = table.client(memnode.connect());
    let past = now_unix_ms() - MAX_CLOCK_SKEW_MS - 1000;
    for i in 0..200 {
        c.put_opts(format!("k{i}").as_bytes(), b"v", at(past, PutMode::Upsert)).unwrap();
    }
    // A grace period and an interval longer than the test, so that nothing here depends on
    // how fast the machine runs (a TCG VM once took longer than a 1 ms grace for the cycle).
    let interval = Duration::from_secs(3600);
    let grace = Duration::from_secs(600);
    let mut expiry = memnode.active_expiry(ExpiryOptions { interval, grace, ..ExpiryOptions::default() });
    let sleep = expiry.run_due().unwrap();
    assert_eq!(expiry.cycles(), 1);
    let pending = expiry.pending_bytes();
    assert!(pending > 0, "the cycle removed the expired items");
    assert!(sleep <= grace, "woken to give the removed blocks back: {sleep:?}");
    // Woken early, as for a release or for nothing, again and again: no second cycle.
    for _ in 0..10 {
        let sleep = expiry.run_due().unwrap();
        assert!(sleep <= grace, "{sleep:?}");
    }
    assert_eq!(expiry.cycles(), 1, "no cycle before the interval is over");
    assert_eq!(expiry.pending_bytes(), pending, "nothing given back before the grace period ends");
}

/// The memnode leaves an item alone until its expiry is the tolerated clock skew past.
#[test]
fn active_expiry_waits_out_the_tolerated_skew() {
    let memnode = TestMemnode::start(Via::Local, 16 * MIB, 4);
    let table = memnode.table(options(1));
    let mut c = table.client(memnode.connect());
    let expires_at = now_unix_ms() + HOUR_MS;
    for i in 0..20 {
        c.put_opts(format!("k{i}").as_bytes(), b"v", at(expires_at, PutMode::Upsert)).unwrap();
    }
    c.flush().unwrap();
    let mut expiry = memnode.active_expiry(ExpiryOptions::default());
    // Judged at the last millisecond of the tolerance, nothing goes, however often sampled.
    let mut with_expiry = 0;
    while with_expiry < 2000 {
        let round = expiry.sample_round(expires_at + MAX_CLOCK_SKEW_MS).unwrap();
        assert_eq!(round.removed, 0, "removed within the tolerated skew");
        with_expiry += round.with_expiry;
    }
    // One millisecond later, everything does.
    let mut removed = 0;
    for _ in 0..100_000 {
        removed += expiry.sample_round(expires_at + MAX_CLOCK_SKEW_MS + 1).unwrap().removed;
        if removed == 20 {
            break;
        }
    }
    assert_eq!(removed, 20);
    expiry.flush_count().unwrap();
    assert_eq!(memnode.stats().items, 0);
}

/// Writers, readers, expiry updates and the memnode's sampling at once, with splits: no
/// read ever returns an item after its expiry, and no key without one is ever lost.
///
/// Each value carries the expiry it was written with (u64::MAX: none), and expiry updates
/// only ever shorten one, so a value read at time t must carry an expiry of t or later.
fn concurrent_expiry(via: Via) {
    const WRITERS: usize = 2;
    const READERS: usize = 2;
    const KEYS_PER_WRITER: usize = 600;
    const OPS_PER_WRITER: usize = 8_000;
    let memnode = TestMemnode::start(via, 64 * MIB, 4);
    let table = memnode.table(options(2));
    let done = AtomicBool::new(false);
    let writers_left = AtomicU64::new(WRITERS as u64);
    let key =
        |w: usize, i: usize| format!("w{w}-{}{i:04}", if i.is_multiple_of(2) { "kept" } else { "soon" }).into_bytes();
    let encode = |expires: Option<u64>, seq: u64| {
        let mut v = expires.unwrap_or(u64::MAX).to_le_bytes().to_vec();
        v.extend_from_slice(&seq.to_le_bytes());
        v
    };
    let carried = |v: &[u8]| u64::from_le_bytes(v[..8].try_into().unwrap());
    std::thread::scope(|s| {
        let memnode = &memnode;
        let table = &table;
        let expiry_thread = s.spawn(|| {
            let mut expiry =
                memnode.active_expiry(ExpiryOptions { grace: Duration::from_millis(2), ..Default::default() });
            let mut removed = 0;
            while !done.load(Ordering::Relaxed) {
                // As a memnode whose clock runs the tolerated skew ahead judges (the items
                // here expire within milliseconds, and are read and rewritten all the time).
                removed += expiry.sample_round(now_unix_ms() + MAX_CLOCK_SKEW_MS).unwrap().removed;
                expiry.release_due(std::time::Instant::now()).unwrap();
            }
            removed
        });
        for w in 0..WRITERS {
            let (done, writers_left) = (&done, &writers_left);
            s.spawn(move || {
                let mut c = table.client(memnode.connect());
                let mut rng = SmallRng::seed_from_u64(w as u64);
                // What this writer last wrote to its keys without an expiry.
                let mut kept: HashMap<usize, Vec<u8>> = HashMap::new();
                for seq in 0..OPS_PER_WRITER as u64 {
                    let i = rng.random_range(0..KEYS_PER_WRITER);
                    let k = key(w, i);
                    if i.is_multiple_of(2) {
                        // Kept keys: no expiry, or one far ahead.
                        let expires = rng.random_bool(0.5).then(|| now_unix_ms() + HOUR_MS);
                        let v = encode(expires, seq);
                        c.put_opts(&k, &v, PutOptions { expiry: Expiry::from_ms(expires), ..Default::default() })
                            .unwrap();
                        kept.insert(i, v);
                        let check = *kept.keys().nth(rng.random_range(0..kept.len())).unwrap();
                        let got = c.get(&key(w, check)).unwrap();
                        assert_eq!(got.as_ref(), kept.get(&check), "kept key {check} of writer {w} lost");
                        continue;
                    }
                    match rng.random_range(0..4) {
                        0 | 1 => {
                            let expires = now_unix_ms() + rng.random_range(0..20);
                            c.put_opts(&k, &encode(Some(expires), seq), at(expires, PutMode::Upsert)).unwrap();
                        }
                        2 => {
                            // Shorten (never lengthen) the expiry, as EXPIRE ... LT does.
                            let when = now_unix_ms() + rng.random_range(0..10);
                            c.update_expiry(&k, |cur| match cur {
                                Some(cur) if when < cur => ExpiryUpdate::Set(Some(when)),
                                _ => ExpiryUpdate::Unchanged,
                            })
                            .unwrap();
                        }
                        _ => {
                            c.delete(&k).unwrap();
                        }
                    }
                }
                for (i, v) in &kept {
                    assert_eq!(c.get(&key(w, *i)).unwrap().as_ref(), Some(v), "kept key {i} of writer {w} lost");
                }
                if writers_left.fetch_sub(1, Ordering::AcqRel) == 1 {
                    done.store(true, Ordering::Relaxed);
                }
            });
        }
        let readers: Vec<_> = (0..READERS)
            .map(|r| {
                let done = &done;
                s.spawn(move || {
                    let mut c = table.client(memnode.connect());
                    let mut rng = SmallRng::seed_from_u64(100 + r as u64);
                    let mut live_reads = 0u64;
                    while !done.load(Ordering::Relaxed) {
                        let w = rng.random_range(0..WRITERS);
                        let started = now_unix_ms();
                        match rng.random_range(0..3) {
                            0 => {
                                if let Some(v) = c.get(&key(w, rng.random_range(0..KEYS_PER_WRITER))).unwrap() {
                                    assert!(
                                        started <= carried(&v),
                                        "read at {started} ms an item that expired at {}",
                                        carried(&v)
                                    );
                                    live_reads += 1;
                                }
                            }
                            1 => {
                                if let Some(item) = c.get_item(&key(w, rng.random_range(0..KEYS_PER_WRITER))).unwrap() {
                                    let expires = item.expires_at_ms.unwrap_or(u64::MAX);
                                    assert!(
                                        started <= expires,
                                        "read at {started} ms an item that expired at {expires}"
                                    );
                                    assert!(expires <= carried(&item.value), "an expiry update lengthened an expiry");
                                    live_reads += 1;
                                }
                            }
                            _ => {
                                let keys: Vec<Vec<u8>> =
                                    (0..16).map(|_| key(w, rng.random_range(0..KEYS_PER_WRITER))).collect();
                                let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                                for v in c.get_many(&refs).unwrap().into_iter().flatten() {
                                    assert!(
                                        started <= carried(&v),
                                        "read at {started} ms an item that expired at {}",
                                        carried(&v)
                                    );
                                    live_reads += 1;
                                }
                            }
                        }
                    }
                    live_reads
                })
            })
            .collect();
        for r in readers {
            assert!(r.join().unwrap() > 0, "a reader saw nothing live: the test proved little");
        }
        let removed = expiry_thread.join().unwrap();
        assert!(removed > 0, "the memnode's sampling removed nothing: the test proved little");
    });
    assert!(memnode.stats().global_depth >= 3, "the table should have split: {:?}", memnode.stats());
    // No key twice, and every item left is a kept key or one the sampling has not reached.
    let items = scan(&*memnode.connect(), &memnode.layout());
    let mut seen = std::collections::HashSet::new();
    for item in &items {
        assert!(item.admitted, "key {:?} misplaced", String::from_utf8_lossy(&item.key));
        assert!(seen.insert(item.key.clone()), "key {:?} appears twice", String::from_utf8_lossy(&item.key));
    }
}

#[test]
fn concurrent_expiry_local() {
    concurrent_expiry(Via::Local);
}

#[test]
fn concurrent_expiry_tcp() {
    concurrent_expiry(Via::Transport(TransportKind::Tcp));
}
