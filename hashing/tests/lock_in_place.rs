//! A lock from a version read at its slot (`TableClient::txn_lock_at_overlapped`, the
//! snapshot writer's lock): one round trip when nothing moved; a word changed since the read
//! is a conflict; a key a split moved since the read, or a copy that appeared below it,
//! sends the lock down the general path, which locks the key once, where it is now.

mod common;

use common::read_word;
use racekv_hashing::hash::KeyHash;
use racekv_hashing::layout::{digest_fingerprint, key_digest, slot_offset, Slot, TxnMark, SLOTS_PER_BUCKET};
use racekv_hashing::rpc::SplitRequest;
use racekv_hashing::table::txn::{Lock, SlotVersion, TXN_LEASE_MS};
use racekv_hashing::testing::{scan, TestMemnode, Via};
use racekv_hashing::{clock, TableClient, TableOptions};
use racekv_transport::{overlap, Batch};

const GROUPS: u32 = 64;

fn mark(old_word: u64) -> TxnMark {
    TxnMark::of_snapshot(7, old_word, clock::now_unix_ms() + TXN_LEASE_MS)
}

/// Locks `key` for `value` from `version`, at the slot it was read at.
fn lock_at(c: &mut TableClient, key: &[u8], value: &[u8], version: SlotVersion, mark: TxnMark) -> Option<Lock> {
    overlap::block_on(c.txn_lock_at_overlapped(key, Some(value), None, mark, version.slot)).unwrap()
}

/// Locks `key` from what `c` reads of it and publishes `value`; the lock it held.
fn write(c: &mut TableClient, key: &[u8], value: &[u8], version: SlotVersion) -> Lock {
    let m = mark(version.word);
    let lock = lock_at(c, key, value, version, m).unwrap_or_else(|| panic!("{key:?} locked"));
    assert_eq!(c.txn_settle_placed(&[(key, lock, m)], true).unwrap(), 1, "{key:?} published");
    lock
}

/// Locks in place that went back so far, in this process.
fn taken_back() -> u64 {
    racekv_telemetry::metric::counter_total("racekv_txn_locks_in_place_taken_back_total")
}

#[test]
fn a_lock_from_its_read_takes_one_round_trip() {
    let memnode = TestMemnode::start(Via::Local, 32 << 20, GROUPS);
    let table = memnode.table(TableOptions::default());
    let mut c = table.client(memnode.connect());
    c.put(b"k", b"old").unwrap();
    let (_, version) = c.read_versioned(b"k").unwrap();
    let at = version.slot.expect("the only copy is the lowest fingerprint match");
    let before = c.stats().round_trips;
    let m = mark(version.word);
    let lock = lock_at(&mut c, b"k", b"new", version, m).expect("locked");
    assert_eq!(c.stats().round_trips - before, 1, "intent, CAS and checks in one batch");
    assert_eq!((lock.slot, lock.replaced, lock.replaced_checksum), (at, version.word, version.checksum));
    assert!(Slot::decode(read_word(&*memnode.connect(), at)).is_some_and(|s| s.locked));
    assert_eq!(c.txn_settle_placed(&[(b"k", lock, m)], true).unwrap(), 1);
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"new"[..]));
}

#[test]
fn a_word_changed_since_the_read_is_a_conflict() {
    let memnode = TestMemnode::start(Via::Local, 32 << 20, GROUPS);
    let table = memnode.table(TableOptions::default());
    let mut c = table.client(memnode.connect());
    let mut other = table.client(memnode.connect());
    c.put(b"k", b"v1").unwrap();
    let (_, version) = c.read_versioned(b"k").unwrap();
    other.put(b"k", b"v2").unwrap();
    assert_eq!(lock_at(&mut c, b"k", b"v3", version, mark(version.word)), None);
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v2"[..]));
    assert_eq!(scan(&*memnode.connect(), &memnode.layout()).len(), 1, "nothing left of the failed lock");
}

/// Every key's version read, then its subtable split (about half the keys move), then each
/// locked from its old version by a client whose directory is from before the split.
#[test]
fn keys_a_split_moved_since_the_read_are_locked_where_they_are_now() {
    let memnode = TestMemnode::start(Via::Local, 32 << 20, GROUPS);
    let table = memnode.table(TableOptions::default());
    let mut c = table.client(memnode.connect());
    let keys: Vec<Vec<u8>> = (0..400).map(|i| format!("k{i}").into_bytes()).collect();
    for key in &keys {
        c.put(key, b"old").unwrap();
    }
    assert_eq!(table.directory().global_depth(), 0, "no split yet");
    let subtable = table.directory().lookup(0).entry.subtable;
    let versions: Vec<SlotVersion> = keys.iter().map(|k| c.read_versioned(k).unwrap().1).collect();
    let request = SplitRequest { dir_hash: 0, observed_depth: 0, observed_subtable: subtable };
    memnode.local_splitter().split(&request).unwrap();
    let mut moved = 0;
    for (key, &version) in keys.iter().zip(&versions) {
        let lock = write(&mut c, key, b"new", version);
        moved += usize::from(Some(lock.slot) != version.slot);
    }
    assert!(moved > 100, "a split moves about half the keys: {moved} of 400 moved");
    let items = scan(&*memnode.connect(), &memnode.layout());
    assert_eq!(items.len(), keys.len(), "each key once");
    assert!(items.iter().all(|it| it.value == b"new"), "every lock published where the key is");
}

/// A copy of another key with the same fingerprint put below the key's slot after its read:
/// the lock in place goes in, sees it, goes back, and the general path locks the key.
#[test]
fn a_copy_below_the_slot_since_the_read_takes_the_lock_back() {
    let memnode = TestMemnode::start(Via::Local, 32 << 20, GROUPS);
    let conn = memnode.connect();
    let table = memnode.table(TableOptions::default());
    let mut c = table.client(memnode.connect());
    let subtable = table.directory().lookup(0).entry.subtable;
    // A key with a free slot of its buckets below the one it went to.
    let (key, version, below) = (0..200)
        .find_map(|i| {
            let key = format!("key{i}").into_bytes();
            c.put(&key, b"old").unwrap();
            let (_, version) = c.read_versioned(&key).unwrap();
            let at = version.slot?;
            let cbs = KeyHash::of(&key, GROUPS).combined_buckets(subtable, GROUPS);
            let free = cbs
                .iter()
                .flat_map(|cb| [cb.bucket(0), cb.bucket(1)])
                .flat_map(|bucket| (0..SLOTS_PER_BUCKET).map(move |j| slot_offset(bucket, j)))
                .find(|&slot| slot < at && read_word(&*conn, slot) == 0)?;
            Some((key, version, free))
        })
        .expect("a key placed above a free slot of its buckets");
    // The decoy: another key of the same fingerprint, its word copied below the key's.
    let fingerprint = digest_fingerprint(key_digest(&key));
    let decoy = (0..)
        .map(|i| format!("decoy{i}").into_bytes())
        .find(|d| digest_fingerprint(key_digest(d)) == fingerprint)
        .unwrap();
    c.put(&decoy, b"decoy").unwrap();
    let decoy_word =
        scan(&*conn, &memnode.layout()).into_iter().find(|it| it.key == decoy).map(|it| read_word(&*conn, it.slot));
    let mut batch = Batch::new();
    let cas = batch.cas(below, 0, decoy_word.unwrap());
    conn.execute(&mut batch).unwrap();
    assert!(batch.cas_succeeded(cas).unwrap());

    let before = taken_back();
    let lock = write(&mut c, &key, b"new", version);
    assert_eq!(taken_back() - before, 1, "the lock in place went back");
    assert_eq!(Some(lock.slot), version.slot, "then locked at the same slot by the general path");
    assert_eq!(c.get(&key).unwrap().as_deref(), Some(&b"new"[..]));
    assert_eq!(read_word(&*conn, below), decoy_word.unwrap(), "the copy below untouched");
    assert_eq!(c.get(&decoy).unwrap().as_deref(), Some(&b"decoy"[..]));
}
